"""Host memory and CPU time of this process: peak extra memory over a block (``PeakRSS``), CPU seconds and the
machine's idle time (``CpuTime``), page faults, and resident-memory figures from /proc."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import threading


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``VmRSS:``, ``VmHWM:``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def minor_faults() -> int:
    """This process's minor page faults so far: first touches of fresh memory (counted, not timed: load-proof)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def malloc_in_use() -> int | None:
    """Bytes the C heap has handed out (glibc ``mallinfo2``: every arena, mmapped blocks included)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


class PeakRSS:
    """Peak extra host memory of this process during a block, two ways: the C heap's bytes in use (sampled
    every 2 ms: counts every allocation, including memory the allocator reuses without new pages) and resident
    memory (VmHWM after resetting it: new pages only, including memory mapped outside the C heap, such as a
    budgeted save's copies). ``extra`` is the larger of the two.

    ``sample=False`` starts no sampler thread (for a block that is timed as well): the heap is read at the end
    only, so ``extra`` is then mostly the resident-memory figure (pinned or mapped staging memory is in it)."""

    def __init__(self, sample: bool = True) -> None:
        self.extra = 0
        self.extra_rss = 0
        self._sample_heap = sample

    def __enter__(self) -> PeakRSS:
        gc.collect()
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._base = status_bytes("VmRSS:")
        self._heap_base = malloc_in_use()
        self._heap_peak = self._heap_base or 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        if self._sample_heap:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._heap_peak = max(self._heap_peak, malloc_in_use() or 0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._sample_heap:
            self._sampler.join()
        self._heap_peak = max(self._heap_peak, malloc_in_use() or 0)
        self.extra_rss = max(0, status_bytes("VmHWM:") - self._base)
        heap = max(0, self._heap_peak - self._heap_base) if self._heap_base is not None else 0
        self.extra = max(heap, self.extra_rss)  # mappings of their own (budgeted copies) are not in the C heap


def _machine_idle_s() -> float:
    """Seconds all of the machine's cores have spent idle (or waiting for I/O) since boot."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


class CpuTime:
    """Over a ``with`` block: CPU seconds this process used (all threads, user + system; 10 ms resolution) and
    seconds the machine's cores sat idle. Summed over ranks, the first is the work a path does; divided by the
    cores, the least time it can take on this machine."""

    used_s = 0.0
    machine_idle_s = 0.0

    def __enter__(self) -> CpuTime:
        self._times = os.times()
        self._idle = _machine_idle_s()
        return self

    def __exit__(self, *exc: object) -> None:
        t = os.times()
        self.used_s = (t.user - self._times.user) + (t.system - self._times.system)
        self.machine_idle_s = _machine_idle_s() - self._idle


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ResidentPeak:
    """Samples this process's resident memory on a thread (every 2 ms) while active; ``peak`` is the largest
    seen (against a base taken by the caller, e.g. before any checkpointing: what a pool holds counts)."""

    def __init__(self) -> None:
        self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> ResidentPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
