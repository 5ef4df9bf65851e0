"""The dcp suite's measurement on one rank (every rank of a section runs it at once): an untimed pass first (each
path's first two saves under the resident-peak sampler, each load's under it too, and the bit-exact check of every
load), then interleaved repetitions: the baseline copy and every save, then every load, in an order rotated each
repetition. Every figure is the slowest rank's."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from benchmarks.core.files import evict, read_through, remove
from benchmarks.core.memory import ResidentPeak, resident_bytes
from benchmarks.core.ranks import gather, slowest
from benchmarks.core.timing import rotated
from benchmarks.suites.dcp.paths import LoadPath, SavePath, failures, first_line


def settled_rss() -> int:
    """Resident bytes after a collection and after glibc returned its free heap (``malloc_trim``): the base a
    path's peak is taken against, so memory an earlier path freed does not hide this one's."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    return resident_bytes()


@dataclasses.dataclass
class Setup:
    """What one rank measures: its state, the live state loads go into, the save and load paths, the baseline copy
    (seconds), the bit-exact check of a load (None when equal, else what differs) and the device sync."""

    state: Any
    live: Any
    paths: list[SavePath]
    loads: list[LoadPath]
    baseline: Callable[[], float]
    check: Callable[[], str | None]
    scribble: Callable[[], None]
    sync: Callable[[], None]
    root: str
    warm: bool


class Rounds:
    """The untimed pass and the interleaved repetitions of one section, on this rank."""

    def __init__(self, setup: Setup) -> None:
        self.s = setup
        self.failed: dict[str, str] = {}
        self.memory: dict[str, int] = {}
        self.checks: dict[str, str] = {}
        self.rows: list[dict[str, Any]] = []

    def folder(self, key: str, name: str) -> str:
        """Where path ``key`` saves in round ``name``."""
        return os.path.join(self.s.root, key, name)

    def clear(self, paths: list[str]) -> None:
        """Rank 0 removes ``paths`` between two barriers."""
        dist.barrier()
        if dist.get_rank() == 0:
            for p in paths:
                remove(p)
        dist.barrier()

    def live_paths(self) -> list[SavePath]:
        """The save paths that have not failed."""
        return [p for p in self.s.paths if p.key not in self.failed]

    def save(self, path: SavePath, name: str) -> dict[str, float] | None:
        """One save of ``path`` into a fresh folder, the slowest rank's figures; None (and the reason kept) when it
        failed on any rank."""
        folder = self.folder(path.key, name)
        dist.barrier()
        self.s.sync()
        try:
            saved, error = path.save(self.s.state, folder), None
        except failures() as e:
            saved, error = None, first_line(e)
        errors = [e for e in gather(error) if e]
        if errors or saved is None:
            self.failed[path.key] = errors[0] if errors else "failed"
            return None
        return {"blocked_s": slowest(saved.blocked_s), "durable_s": slowest(saved.durable_s)}

    def load(self, load: LoadPath, name: str) -> float | None:
        """One load of ``load``'s files of round ``name`` into the live state (cold unless --warm): the slowest
        rank's seconds, None when its files or the load failed."""
        if load.source in self.failed or load.key in self.failed:
            return None
        folder = self.folder(load.source, name)
        dist.barrier()
        if dist.get_rank() == 0 and self.s.warm:  # all of it cached, whatever way its files were written
            read_through(folder)
        elif dist.get_rank() == 0:
            evict(folder)
        dist.barrier()
        self.s.sync()
        try:
            start = time.perf_counter()
            load.load(self.s.live, folder)
            self.s.sync()
            elapsed, error = time.perf_counter() - start, None
        except failures() as e:
            elapsed, error = 0.0, first_line(e)
        errors = [e for e in gather(error) if e]
        if errors:
            self.failed[load.key] = errors[0]
            return None
        return slowest(elapsed)

    def untimed_pass(self) -> None:
        """Each path's first two saves under the resident-peak sampler (its buffers allocated, then reused), each
        load of those files under it too, and every load checked bit-exact against the saved state."""
        for path in self.s.paths:
            base = settled_rss()
            with ResidentPeak() as peak:
                for name in ("first", "second"):
                    if self.save(path, name) is None:
                        break
            self.memory[path.key] = slowest(peak.peak - base)
        for load in self.s.loads:
            self.s.scribble()
            base = settled_rss()
            with ResidentPeak() as peak:
                done = self.load(load, "second")
            self.memory[load.key] = slowest(peak.peak - base)
            if done is not None:
                self.checks[load.key] = _agreed(self.s.check()) or "bit-exact"
        self.clear([os.path.join(self.s.root, p.key) for p in self.s.paths])

    def repetition(self, rep: int) -> dict[str, Any]:
        """The baseline and every save, then every load, each in an order rotated by ``rep``; the row."""
        name = f"rep{rep}"
        row: dict[str, Any] = {}
        blocks: list[tuple[str, Callable[[], Any]]] = [("baseline", self.timed_baseline)]
        blocks += [(p.key, lambda p=p: self.save(p, name)) for p in self.live_paths()]
        for key, block in rotated(blocks, rep):
            row[key] = block()
        for load in rotated(self.s.loads, rep):
            row[load.key] = self.load(load, name)
        self.clear([self.folder(p.key, name) for p in self.s.paths])
        self.rows.append(row)
        return row

    def timed_baseline(self) -> float:
        """The slowest rank's baseline copy."""
        dist.barrier()
        self.s.sync()
        return slowest(self.s.baseline())

    def result(self) -> dict[str, Any]:
        """The section's figures: every repetition's row, peak memory, checks, failures, the paths' notes."""
        notes = {p.key: p.notes for p in self.s.paths if p.notes}
        labels = {p.key: p.label for p in self.s.paths} | {x.key: x.label for x in self.s.loads}
        return {"rows": self.rows, "peak_extra_bytes": self.memory, "checks": self.checks, "failed": self.failed,
                "notes": notes, "labels": labels}  # fmt: skip


def _agreed(problem: str | None) -> str | None:
    """The first rank's problem, if any rank has one."""
    return next((p for p in gather(problem) if p), None)


def measure(setup: Setup, reps: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """The untimed pass, then ``reps`` repetitions (progress said after each); then every path closed."""
    rounds = Rounds(setup)
    try:
        rounds.untimed_pass()
        for rep in range(reps):
            row = rounds.repetition(rep)
            progress(f"rep {rep}: " + ", ".join(f"{k}={_brief(v)}" for k, v in row.items()))
    finally:
        for path in setup.paths:
            path.close()
    return rounds.result()


def _brief(value: Any) -> str:
    """A row's figure in a progress line."""
    if isinstance(value, dict):
        return "/".join(f"{v:.3f}" for v in value.values())
    return "-" if value is None else f"{value:.3f}"
