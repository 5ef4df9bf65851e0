"""Peak extra host memory of a block of code in this process, for the benchmarks (issue 27's memory figures)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Any


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _malloc_in_use() -> int | None:
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
        import gc

        gc.collect()
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._base = _rss("VmRSS:")
        self._heap_base = _malloc_in_use()
        self._heap_peak = self._heap_base or 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        if self._sample_heap:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._heap_peak = max(self._heap_peak, _malloc_in_use() or 0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._sample_heap:
            self._sampler.join()
        self._heap_peak = max(self._heap_peak, _malloc_in_use() or 0)
        self.extra_rss = max(0, _rss("VmHWM:") - self._base)
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


def receive_exactly(conn: Any, view: memoryview, nbytes: int) -> None:
    """Fill ``view[:nbytes]`` from the socket ``conn`` in 8 MiB reads (the loopback-copy baseline's receiver)."""
    done = 0
    while done < nbytes:
        n = conn.recv_into(view[done : done + (8 << 20)])
        if not n:
            raise RuntimeError("the socket baseline's sender stopped early")
        done += n
