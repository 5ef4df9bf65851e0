"""A save called after the optimizer step, before the step's sync (as loops written for NxD do), against the same
step alone: device time."""

from __future__ import annotations

import os
import time

from benchmarks.core.files import remove
from benchmarks.suites.device.run import RunCore


class BeforeSync(RunCore):
    """The before_sync block."""

    def before_sync(self) -> None:
        """A save called after the optimizer step, before the step's sync (as loops written for NxD do): device time
        from the step's start to the end of the user's sync (XLA: executions, CUDA: wall, synchronised), against the
        same step without a save, in turn."""
        import nxd_ckpt as nxd

        path = os.path.join(self.root, "before_sync")
        for name in ("step_alone", "step_save_before_sync"):
            self.dev.sync()
            device0, wall0 = self.dev.device_time_s(), time.perf_counter()
            self.tr.trace_step()
            report = None
            if name == "step_save_before_sync":
                try:
                    report = nxd.save_checkpoint(
                        path, f"r{self.rep}", model=self.tr.model, optimizer=self.tr.opt, use_xser=True, async_save=True
                    )
                except Exception as e:
                    self.failed(name, e, loud=True)
                    return
            if self.dev.kind == "xla":
                self.dev.xla.sync()  # the user's sync
            self.dev.sync()
            device1, wall = self.dev.device_time_s(), time.perf_counter() - wall0
            spent = device1 - device0 if device1 is not None and device0 is not None else wall
            ran = f", ran the pending step: {getattr(report, 'ran_pending_step', '?')}" if report is not None else ""
            self.add(name, spent, f"{name.replace('_', ' ')}: device time {spent:.3f} s (wall {wall:.3f} s){ran}")
            if report is not None:
                report.wait()
                remove(os.path.join(path, f"r{self.rep}"))
