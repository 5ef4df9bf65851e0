"""The saveload suite's harness: what a section gets (``Bench``: this rank's state, a scratch directory shared by
all ranks, barrier-to-barrier timing, cold loads), what it returns (``Timing``), and the section registry."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.core.memory import PeakRSS
from benchmarks.core.ranks import gather
from benchmarks.core.state import assert_same, live_module


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

    def path(self, name: str) -> str:
        """``name`` in the shared scratch directory."""
        return os.path.join(self.root, name)

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds from a barrier before ``fn`` on every rank to a barrier after it on every rank."""
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def timed_load(self, fn: Callable[[], Any]) -> float:
        """``timed`` after dropping the page cache (a cold load)."""
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
        """Rank 0 drops the page cache between two barriers (when the run is cold)."""
        dist.barrier()
        if self.rank == 0 and self.cold:
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
        dist.barrier()

    def clean(self, name: str) -> None:
        """Rank 0 removes ``name`` from the scratch directory between two barriers."""
        dist.barrier()
        if self.rank == 0:
            full = self.path(name)
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
        dist.barrier()


REGISTRY: dict[str, tuple[str, Callable[[Bench], Timing], Callable[[], bool]]] = {}
"""name -> (label, section function, whether it can run here); the registration order is the run order."""


def section(name: str, label: str, available: Callable[[], bool] = lambda: True) -> Callable:
    """Register a benchmark section: ``fn(bench) -> Timing``, run on every rank."""

    def register(fn: Callable[[Bench], Timing]) -> Callable[[Bench], Timing]:
        REGISTRY[name] = (label, fn, available)
        return fn

    return register


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


def with_peak(b: Bench, timing: Timing, peak: PeakRSS) -> Timing:
    """``timing`` with the load's peak extra host memory (largest rank, GB): heap or new pages, and pages only."""
    timing.extra["peak_gb"] = max(gather(peak.extra)) / 1e9
    timing.extra["peak_rss_gb"] = max(gather(peak.extra_rss)) / 1e9
    return timing
