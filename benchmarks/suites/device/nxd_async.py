"""Steady nxd async saves (xser, plain, device_snapshot_budget=0), and the check that an async save followed at once
by optimizer steps holds the state of the call."""

from __future__ import annotations

import os

import torch

from benchmarks.core.devices import first_difference
from benchmarks.core.files import remove
from benchmarks.suites.device.run import RunCore, say
from benchmarks.suites.device.saves import describe_save, nxd_save


class NxdAsync(RunCore):
    """The nxd async block and the snapshot check."""

    def nxd_async(self, name: str, label: str, *, xser: bool, extra: dict | None = None, count: int = 1) -> None:
        """``count`` steady async saves (two steps before each), each said and kept as ``name``."""
        path = os.path.join(self.root, name)
        for i in range(count):
            self.tr.steps(2)
            tag = f"r{self.rep}_{i}"
            try:
                figures = nxd_save(self.dev, path, tag, self.tr, xser=xser, async_save=True, extra=extra)
            except Exception as e:
                self.failed(name, e, loud=True)
                return
            finally:
                remove(os.path.join(path, tag))
            self.add(name, figures, f"{label} #{i + 1}: {describe_save(figures)}")

    def check_async_snapshot(self) -> None:
        """An async save followed at once by optimizer steps (which change the state in place while the save is
        written): the tag must hold the state of the call."""
        import nxd_ckpt as nxd

        path, tag = os.path.join(self.root, "check_async"), "snapshot"
        self.tr.steps(2)
        expected = self.dev.reference(self.tr.tensors())
        try:
            report = nxd.save_checkpoint(
                path, tag, model=self.tr.model, optimizer=self.tr.opt, use_xser=True, async_save=True
            )
            self.tr.steps(2)
            report.wait()
            model, optim = {}, {}
            nxd.load_checkpoint(path, tag, model=model, optimizer=optim)
        except Exception as e:
            self.failed("check_async", e, loud=True)
            return
        finally:
            remove(path)
        names = list(self.tr.model.state_dict())
        loaded = [model[k] for k in names]
        for i in range(len(names)):
            state = optim["state"][i]
            loaded += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        diff = first_difference(expected, loaded)
        self.checks["async save holds the state of the call (steps right after it)"] = diff or "equal"
        outcome = "OK, bit-exact" if not diff else f"DIFFERS: {diff}"
        say(f"{self.where()} check: async save + immediate steps: {outcome}")
