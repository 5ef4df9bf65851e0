"""Helpers shared by the benchmark scripts (imported by them, never run): scripts/benchmark.py's section
registry and harness (``section``, ``Bench``, ``Timing``), state checks and the live module a resume loads into,
host memory / CPU time measurement (``PeakRSS``, ``CpuTime``), and the loopback S3 set-up that scripts/bench_s3.py
and benchmark.py's ``s3_loopback`` section share. Scripts import this module, never each other.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------- host memory, CPU time


def _rss(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``VmRSS:``, ``VmHWM:``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

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


# ----------------------------------------------------------------------------------------------- state


def dist_all_gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of nested state, in nxd_ckpt's traversal order."""
    from nxd_ckpt.tree import iter_tensors

    return [t for _, t in iter_tensors(tree)]


def nbytes_of(tree: Any) -> int:
    """Bytes of tensor data in nested state."""
    return sum(t.numel() * t.element_size() for t in tensors_of(tree))


def assert_same(a: Any, b: Any, what: str) -> None:
    """Raise unless ``b`` (a loaded state) holds ``a``'s tensors, equal and in the same order."""
    ta, tb = tensors_of(a), tensors_of(b)
    if len(ta) != len(tb) or not all(torch.equal(x, y.cpu()) for x, y in zip(ta, tb, strict=True)):
        raise AssertionError(f"{what}: loaded state differs from the saved one")


# ----------------------------------------------------------------------------------------------- harness


@dataclass
class Timing:
    """What a section returns: save and load seconds (``None`` where it has no such step), and extra figures."""

    save_s: float | None = None
    load_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    """Figures beyond save/load (the async sections: time blocked in the call, the memcpy baseline)."""


@dataclass
class Bench:
    """What a section needs: this rank's state, a scratch directory shared by all ranks, and timing helpers."""

    rank: int
    world: int
    root: str
    model: dict
    optimizer: dict
    total_bytes: int
    cold: bool
    check: bool = True
    scratch: list[str] = field(default_factory=list)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds from a barrier before ``fn`` on every rank to a barrier after it on every rank."""
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def timed_load(self, fn: Callable[[], Any]) -> float:
        self.drop_caches()
        return self.timed(fn)

    def timed_load_then_peak(
        self, fn: Callable[[], Any], reset: Callable[[], Any] | None = None
    ) -> tuple[float, PeakRSS]:
        """A cold timed load, then one more (untimed, the page cache as left) under ``PeakRSS``: its sampler
        thread (every 2 ms, taking the allocator's lock) and its gc.collect stay out of the timed load.
        ``reset`` (e.g. dropping what the load returned) runs before each, outside the measurement."""
        if reset is not None:
            reset()
        seconds = self.timed_load(fn)
        if reset is not None:
            reset()
        peak = PeakRSS()
        with peak:
            fn()
        return seconds, peak

    def drop_caches(self) -> None:
        dist.barrier()
        if self.rank == 0 and self.cold:
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
        dist.barrier()

    def clean(self, name: str) -> None:
        dist.barrier()
        if self.rank == 0:
            full = self.path(name)
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
        dist.barrier()


SECTIONS: dict[str, tuple[str, Callable[[Bench], Timing], Callable[[], bool]]] = {}


def section(name: str, label: str, available: Callable[[], bool] = lambda: True) -> Callable:
    """Register a benchmark section: ``fn(bench) -> Timing``, run on every rank."""

    def register(fn: Callable[[Bench], Timing]) -> Callable[[Bench], Timing]:
        SECTIONS[name] = (label, fn, available)
        return fn

    return register


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (for writers that do not make their files durable)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_fsynced(obj: Any, path: str) -> None:
    """``torch.save`` to ``path``, durable on return."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------- live module (resume)


def live_module(model: dict, device: Any = None) -> torch.nn.Module:
    """An ``nn.Module`` whose state_dict keys are ``model``'s, with its own touched parameter memory (a model
    already built in the resuming process), optionally on ``device``."""
    root = torch.nn.Module()
    for key, value in model.items():
        *owners, leaf = key.split(".")
        module = root
        for name in owners:
            if not hasattr(module, name):
                module.add_module(name, torch.nn.Module())
            module = getattr(module, name)
        module.register_parameter(leaf, torch.nn.Parameter(torch.ones_like(value), requires_grad=False))
    return root.to(device) if device is not None else root


_LIVE: dict[str, torch.nn.Module] = {}


def live(b: Bench, device: str | None = None) -> torch.nn.Module:
    """The process's live module for ``b.model`` (on the CPU or ``"xla"``), built once and reused."""
    key = device or "cpu"
    if key not in _LIVE:
        dev = None
        if device == "xla":
            import torch_xla

            dev = torch_xla.device()
        _LIVE[key] = live_module(b.model, dev)
        if dev is not None:
            import torch_xla

            torch_xla.sync()
    return _LIVE[key]


def check_live(b: Bench, module: torch.nn.Module, what: str) -> None:
    """Check a load into the live module (when ``b.check``), then scribble over it for the next load."""
    if b.check:
        loaded = module.state_dict()
        assert_same(b.model, {k: loaded[k].detach() for k in b.model}, what)
    with torch.no_grad():  # scribble, so the next load must really bring the bytes back
        for p in module.parameters():
            p.fill_(1.0)


# ----------------------------------------------------------------------------------------------- loopback S3

S3_TITLE = "S3 (loopback moto server)"
S3_BUCKET = "nxd-ckpt-bench"


def apply_loopback_s3_env(endpoint_url: str) -> None:
    """Point this process's AWS environment at the loopback moto server at ``endpoint_url``."""
    from harness.s3server import loopback_aws_environ

    for key, value in loopback_aws_environ(endpoint_url).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
