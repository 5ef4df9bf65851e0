"""The device's own limits: a device->host copy into pinned buffers (CUDA) or one bulk transfer (XLA), a device
clone of the state, a training step with no save in flight, and the disk write of the copied bytes."""

from __future__ import annotations

import os
import time

from benchmarks.core.devices import nbytes
from benchmarks.core.files import remove, write_fsynced
from benchmarks.suites.device.run import RunCore


class Floors(RunCore):
    """The floors block."""

    def floors(self) -> None:
        """(a) device->host copy, (b) device clone + sync, a step alone, (c) disk write + fsync of (a)'s bytes."""
        tensors = self.tr.tensors()
        device_bytes = nbytes(self.dev.on_device(tensors))
        copy_s, host = self.dev.pinned_copy(tensors)
        what = "pinned d2h copy" if self.dev.kind == "cuda" else "bulk _xla_get_cpu_tensors"
        self.add("floor_copy_s", copy_s, f"floor {what}: {copy_s:.3f} s ({device_bytes / copy_s / 1e9:.2f} GB/s)")
        clone_s = self.dev.clone_sync(tensors)
        self.add("floor_clone_s", clone_s, f"floor device clone + sync: {clone_s:.3f} s")
        start = time.perf_counter()
        self.tr.steps(1)
        step_s = time.perf_counter() - start
        self.add("floor_step_s", step_s, f"one training step (synced), no save in flight: {step_s:.3f} s")
        path = os.path.join(self.root, "floor.bin")
        start = time.perf_counter()
        write_fsynced(path, host)
        disk_s = time.perf_counter() - start
        remove(path)
        del host
        self.add(
            "floor_disk_s", disk_s, f"floor disk write + fsync: {disk_s:.3f} s ({device_bytes / disk_s / 1e9:.2f} GB/s)"
        )
