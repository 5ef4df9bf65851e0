"""Cold loads into the live model and optimizer on the device: nxd ``load_checkpoint``, ``torch.load`` +
``load_state_dict`` and ``dcp.load``, each checked bit for bit in the first repetition."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.core.devices import first_difference
from benchmarks.core.report import fmt_bytes
from benchmarks.suites.device.run import RunCore, say


class Loads(RunCore):
    """The loads block."""

    def timed_load(self, name: str, fn: Callable[[], None], expected: list[torch.Tensor] | None) -> None:
        """One cold load ``fn`` (the state scribbled first when ``expected`` is given, then checked against it)."""
        if expected is not None:
            self.tr.scribble()
        self.cache.drop()
        base = self.dev.mem_start()
        try:
            start = time.perf_counter()
            fn()
            self.dev.sync()
            elapsed = time.perf_counter() - start
        except Exception as e:
            self.failed(name, e, loud=name == "load_nxd")
            if expected is not None:  # put the state back for the next rows
                self.restore(expected)
            return
        peak = self.dev.mem_peak(base)
        state = "cold" if self.cache.cold else "WARM"
        extra = f", extra device memory {fmt_bytes(peak)}" if peak is not None else ""
        self.add(name, {"s": elapsed, "dev_peak": peak}, f"{name} ({state}): {elapsed:.3f} s{extra}")
        if expected is not None:
            diff = first_difference(expected, self.dev.readable(self.tr.tensors()))
            self.checks[f"{name} restores the saved state"] = diff or "equal"
            say(f"{self.where()} check: {name}: {'OK, bit-exact' if not diff else 'DIFFERS: ' + diff}")
            if diff:
                self.restore(expected)

    def restore(self, expected: list[torch.Tensor]) -> None:
        """Put ``expected`` back into the live state (after a failed or wrong load)."""
        with torch.no_grad():
            for t, e in zip(self.tr.tensors(), expected, strict=False):
                t.copy_(e)
        self.dev.sync()

    def load_nxd(self, path: str, tag: str) -> None:
        """nxd's verified load into the live model and optimizer."""
        import nxd_ckpt as nxd

        nxd.load_checkpoint(path, tag, model=self.tr.model, optimizer=self.tr.opt)

    def load_torch(self, path: str) -> None:
        """``torch.load`` + ``load_state_dict`` of both."""
        # torch.load cannot place storages on an XLA device ("don't know how to restore data location of
        # torch.storage.UntypedStorage (tagged with xla:0)"): there it loads to the CPU and load_state_dict moves it.
        location = self.dev.device if self.dev.kind == "cuda" else "cpu"
        state = torch.load(path, map_location=location, weights_only=True)
        self.tr.model.load_state_dict(state["model"])
        self.tr.opt.load_state_dict(state["optim"])
        del state

    def load_dcp(self, path: str) -> None:
        """``dcp.load`` into the live state dicts + the optimizer's ``load_state_dict``."""
        import torch.distributed.checkpoint as dcp

        state = self.tr.state_dicts()
        dcp.load(state, checkpoint_id=path)
        self.tr.opt.load_state_dict(state["optim"])
