"""A test harness for device snapshots: hold the background device -> host transfer until the test lets it go.

A test saves asynchronously, runs optimizer steps while every chunk of ``device.transfer.DeviceTransfer`` waits
here, then releases them: a save that did not snapshot on the device would then write the state after the steps.
"""

from __future__ import annotations

import threading
from typing import Any

from nxd_ckpt.device.snapshot import DeviceCopies
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.tree import map_tensors


class HeldTransfer:
    """Patches the device -> host copies of async saves (through ``monkeypatch``) so that they wait for
    ``release``: with ``hold="chunks"`` each chunk of a ``DeviceTransfer`` (``_copy_chunk``) and each batch of
    device copies staged under a host memory budget (``DeviceCopies.fetch``), with ``hold="thread"`` a
    ``DeviceTransfer``'s whole job on the transfer thread (``_run``: also the wait for copies the save's call queued
    itself). ``threads`` lists the threads that waited."""

    def __init__(self, monkeypatch: Any, timeout_s: float = 120.0, hold: str = "chunks") -> None:
        if hold not in ("chunks", "thread"):
            raise ValueError(f"hold must be 'chunks' or 'thread', got {hold!r}")
        self.released = threading.Event()
        self.threads: list[int] = []
        targets = [(DeviceTransfer, "_copy_chunk"), (DeviceCopies, "fetch")] if hold == "chunks" else []
        for owner, name in targets or [(DeviceTransfer, "_run")]:
            monkeypatch.setattr(owner, name, self._held(getattr(owner, name), timeout_s))

    def _held(self, real: Any, timeout_s: float) -> Any:
        def held(owner: Any, *args: Any) -> Any:
            self.threads.append(threading.get_ident())
            if not self.released.wait(timeout_s):
                raise TimeoutError(f"the test never released the held transfer ({timeout_s:g} s)")
            return real(owner, *args)

        return held

    def release(self) -> None:
        self.released.set()


def host_copy(state: Any) -> Any:
    """A host copy of nested state that later training steps cannot change."""
    return map_tensors(state, lambda t: t.detach().cpu().clone())
