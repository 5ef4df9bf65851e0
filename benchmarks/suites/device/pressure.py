"""An async save with ``device_snapshot_budget="auto"`` on a device filled to within 10% of its size."""

from __future__ import annotations

import os

from benchmarks.core.files import remove
from benchmarks.core.report import fmt_bytes
from benchmarks.suites.device.run import RunCore
from benchmarks.suites.device.saves import describe_save, nxd_save


class Pressure(RunCore):
    """The pressure block."""

    def pressure(self) -> None:
        """An async save with ``device_snapshot_budget="auto"`` on a device filled to within 10% of its size, then a
        training step (it must run): blocked time against the steady saves', what the snapshot took, and whether it
        fell back to the direct transfer. The process-wide manager is replaced first, so the budget is decided anew
        under the pressure (a manager keeps its budget from save to save)."""
        from nxd_ckpt.api import reset_manager

        path = os.path.join(self.root, "pressure")
        reset_manager()
        filler, left = self.dev.fill(0.10)
        try:
            self.tr.steps(2)
            figures = nxd_save(self.dev, path, "pressure", self.tr, xser=True, async_save=True)
            self.tr.steps(1)
        except Exception as e:
            self.failed("pressure", e, loud=True)
            return
        finally:
            del filler
            reset_manager()
            remove(path)
        fields = figures["report"]
        fallback = fields.get("device_snapshot_fallback")
        self.add(
            "pressure",
            figures,
            f"memory pressure ({fmt_bytes(left)} left free): {describe_save(figures)}; snapshot "
            f"{fmt_bytes(fields.get('device_snapshot_bytes'))}, direct {fmt_bytes(fields.get('device_direct_bytes'))}, "
            f"budget {fmt_bytes(fields.get('device_budget_bytes'))}, fallback: {fallback}",
        )
