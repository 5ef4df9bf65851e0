"""Peak extra host memory of the nxd paths (sampler on; untimed runs after the repetitions) and their device figures."""

from __future__ import annotations

import os

from benchmarks.core.files import remove
from benchmarks.core.memory import PeakRSS
from benchmarks.core.report import fmt_bytes
from benchmarks.suites.device.loads import Loads
from benchmarks.suites.device.saves import describe_save, nxd_save


class Memory(Loads):
    """The memory block (untimed)."""

    def memory(self) -> None:
        """Peak extra host memory of the nxd paths (sampler on; untimed runs) and their device figures: an async
        save until durable, a load of its tag into the live model, and a sync save (not on CUDA by default, where a
        sync save stages nothing on the host: 0.6 MB at 1 and 10 GB; ``--skip`` without ``memory_sync`` adds it)."""
        path = os.path.join(self.root, "memory")
        runs = [("mem_async", "async save until durable", True)]
        if self.on("memory_sync"):
            runs.append(("mem_sync", "sync save", False))
        for name, label, async_save in runs:
            self.tr.steps(2)
            peak = PeakRSS()
            try:
                with peak:
                    figures = nxd_save(self.dev, path, name, self.tr, xser=True, async_save=async_save)
            except Exception as e:
                self.failed(name, e, loud=True)
                continue
            figures |= {"host_extra": peak.extra, "host_extra_rss": peak.extra_rss}
            self.add(
                name,
                figures,
                f"memory, nxd {label}: extra host memory {fmt_bytes(peak.extra)} (resident "
                f"{fmt_bytes(peak.extra_rss)}), {describe_save(figures)}",
            )
            if async_save and self.on("loads"):
                self.memory_load(path, name)
        remove(path)

    def memory_load(self, path: str, tag: str) -> None:
        """Peak extra host and device memory of a (warm) nxd load of ``tag`` into the live model."""
        peak = PeakRSS()
        base = self.dev.mem_start()
        try:
            with peak:
                self.load_nxd(path, tag)
                self.dev.sync()
        except Exception as e:
            self.failed("mem_load", e, loud=True)
            return
        dev_peak = self.dev.mem_peak(base)
        self.add(
            "mem_load",
            {"host_extra": peak.extra, "host_extra_rss": peak.extra_rss, "dev_peak": dev_peak},
            f"memory, nxd load into the live model (warm): extra host memory {fmt_bytes(peak.extra)} "
            f"(resident {fmt_bytes(peak.extra_rss)}), extra device memory {fmt_bytes(dev_peak)}",
        )
