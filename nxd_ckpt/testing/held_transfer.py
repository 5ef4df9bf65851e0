"""A test harness for device snapshots: hold the background device -> host transfer until the test lets it go.

A test saves asynchronously, runs optimizer steps while every chunk of ``device.transfer.DeviceTransfer`` waits
here, then releases them: a save that did not snapshot on the device would then write the state after the steps.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.tree import map_tensors


class HeldTransfer:
    """Patches ``DeviceTransfer._copy_chunk`` (through ``monkeypatch``) so that every chunk waits for ``release``;
    ``threads`` lists the threads the chunks were copied on."""

    def __init__(self, monkeypatch: Any, timeout_s: float = 120.0) -> None:
        self.released = threading.Event()
        self.threads: list[int] = []
        real = DeviceTransfer._copy_chunk

        def held(transfer: DeviceTransfer, sources: list[torch.Tensor]) -> list[torch.Tensor]:
            self.threads.append(threading.get_ident())
            if not self.released.wait(timeout_s):
                raise TimeoutError(f"the test never released the held transfer ({timeout_s:g} s)")
            return real(transfer, sources)

        monkeypatch.setattr(DeviceTransfer, "_copy_chunk", held)

    def release(self) -> None:
        self.released.set()


def host_copy(state: Any) -> Any:
    """A host copy of nested state that later training steps cannot change."""
    return map_tensors(state, lambda t: t.detach().cpu().clone())
