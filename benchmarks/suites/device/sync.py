"""The saves that are loaded back, all of one state: nxd's sync save, torch.save and DCP's async_save, in a rotated
order, then their loads (``loads``)."""

from __future__ import annotations

import os

from benchmarks.core.files import remove
from benchmarks.core.report import fmt_bytes
from benchmarks.suites.device.run import RunCore
from benchmarks.suites.device.saves import nxd_save


class SyncSaves(RunCore):
    """The saves that are loaded back, and their loads (methods of ``Peers`` and ``Loads``)."""

    def saves_and_loads(self) -> None:
        """nxd sync, torch.save and DCP saves of one state in a rotated order, then their loads, rotated too."""
        self.tr.steps(2)
        expected = self.dev.reference(self.tr.tensors()) if self.check else None
        nxd_path, tag = os.path.join(self.root, "nxd_sync"), f"r{self.rep}"
        torch_path = os.path.join(self.root, "torch_save.pt")
        dcp_path = os.path.join(self.root, f"dcp_r{self.rep}")
        saved: dict[str, bool] = {}
        savers = []
        if self.on("sync") or self.on("loads"):
            savers.append(("nxd_sync", lambda: self.save_nxd_sync(nxd_path, tag)))
        if self.on("torch_save"):
            savers.append(("torch_save", lambda: self.save_torch(torch_path)))
        if self.on("dcp"):
            savers.append(("dcp_async", lambda: self.save_dcp(dcp_path)))
        k = self.rep % max(1, len(savers))
        for name, fn in savers[k:] + savers[:k]:
            saved[name] = fn()
        if self.on("loads"):
            loaders = []
            if saved.get("nxd_sync"):
                loaders.append(("load_nxd", lambda: self.load_nxd(nxd_path, tag)))
            if saved.get("torch_save"):
                loaders.append(("load_torch", lambda: self.load_torch(torch_path)))
            if saved.get("dcp_async"):
                loaders.append(("load_dcp", lambda: self.load_dcp(dcp_path)))
            k = self.rep % max(1, len(loaders))
            for name, fn in loaders[k:] + loaders[:k]:
                self.timed_load(name, fn, expected)
        for path in (nxd_path, torch_path, dcp_path):
            remove(path)

    def save_nxd_sync(self, path: str, tag: str) -> bool:
        """nxd's sync xser save, said; False when it failed."""
        try:
            figures = nxd_save(self.dev, path, tag, self.tr, xser=True, async_save=False)
        except Exception as e:
            self.failed("nxd_sync", e, loud=True)
            return False
        peak = f", extra device memory {fmt_bytes(figures['dev_peak'])}" if figures["dev_peak"] is not None else ""
        self.add("nxd_sync", figures, f"nxd sync save (xser): {figures['call_s']:.3f} s to durable{peak}")
        return True
