"""Instrumentation of the simulated ranks: when each arrives at and leaves every cross-rank step and the commit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nxd_ckpt.save import barrier as commit_barrier
from nxd_ckpt.testing.threadworld import ThreadCoordinator


class _Clock:
    """Arrival and departure times of every rank at every cross-rank step (and at the commit)."""

    def __init__(self, size: int) -> None:
        self.arrive: list[list[float]] = [[] for _ in range(size)]
        self.leave: list[list[float]] = [[] for _ in range(size)]
        self.woke: list[list[float]] = [[] for _ in range(size)]
        """When each rank's store wait at each step returned (node barriers: when it left them)."""
        self.cpu: list[list[tuple[float, float]]] = [[] for _ in range(size)]
        """Each rank's own CPU time (``time.thread_time``) at its wake-up and at its departure, per step."""
        self.commit: dict[tuple[int, int], dict[str, float]] = {}
        self.world_steps = 0
        """Store-gated steps of the whole world (rank 0 counts them): each ends with the store releasing N ranks."""
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every mark (before the next operation)."""
        for lst in (*self.arrive, *self.leave, *self.woke, *self.cpu):
            lst.clear()
        self.commit.clear()
        self.world_steps = 0

    def releases(self) -> int:
        """Times the store released every rank: the world-wide steps and each commit's outcome."""
        return self.world_steps + len({seq for seq, _ in self.commit})

    def mark(self, seq: int, rank: int, event: str) -> None:
        """When ``rank`` reached ``event`` of commit ``seq``."""
        with self._lock:
            self.commit.setdefault((seq, rank), {})[event] = time.perf_counter()

    def parallel_s(self) -> float:
        """The critical path with the ranks' own work after each release run in parallel, as a job runs it:
        per step, from the last arrival to the first rank's wake-up (the store's work), plus the largest CPU
        time one rank spent between its wake-up and its departure (its own Python and the collective's), not
        the time it queued for this process's GIL behind the other rank threads; plus the commit as in
        ``coordination_s``."""
        steps = min(len(c) for c in self.cpu) if self.cpu else 0
        total = 0.0
        for k in range(steps):
            last_in = max(a[k] for a in self.arrive)
            total += max(0.0, min(w[k] for w in self.woke) - last_in)
            total += max(c[k][1] - c[k][0] for c in self.cpu)
        return total + self._commit_s()[1]

    def _commit_s(self) -> tuple[float, float]:
        """The commits' coordination: (to the last rank knowing the outcome, to the first one knowing it)."""
        total = critical = 0.0
        for seq in sorted({s for s, _ in self.commit}):
            marks = {r: m for (s, r), m in self.commit.items() if s == seq}
            arrived = [m["arrived"] for m in marks.values() if "arrived" in m]
            master = marks.get(0, {})
            if arrived and "all_arrived" in master:
                gathered = max(0.0, master["all_arrived"] - max(arrived))
                total, critical = total + gathered, critical + gathered
            outcome = [m["outcome"] for m in marks.values() if "outcome" in m]
            if outcome and "published" in master:
                total += max(0.0, max(outcome) - master["published"])
                critical += max(0.0, min(outcome) - master["published"])
        return total, critical

    def coordination_s(self) -> tuple[float, float, int]:
        """(seconds from each step's last arrival to its last departure, summed with the commit's; the same to
        each step's first departure, the critical path; steps).

        The first is what the simulation shows; the second leaves out the time the simulated ranks wait for one
        another on this machine's cores and GIL once they are released (a job's ranks resume in parallel)."""
        steps = min(len(a) for a in self.arrive) if self.arrive else 0
        total = critical = 0.0
        for k in range(steps):
            last_in = max(a[k] for a in self.arrive)
            total += max(0.0, max(lv[k] for lv in self.leave) - last_in)
            critical += max(0.0, min(lv[k] for lv in self.leave) - last_in)
        commit_total, commit_critical = self._commit_s()
        total, critical = total + commit_total, critical + commit_critical
        return total, critical, steps


class TimedCoordinator(ThreadCoordinator):
    """A ThreadWorld rank that records when it arrives at and leaves every cross-rank step."""

    clock: _Clock

    def _arrive_and_wait(self, phase: str) -> None:
        self.clock.arrive[self.rank].append(time.perf_counter())
        if self.rank == 0:
            self.clock.world_steps += 1
        super()._arrive_and_wait(phase)
        self.clock.woke[self.rank].append(time.perf_counter())
        self._cpu_woke = time.thread_time()

    def _node_barrier(self, local_rank: int, local_world_size: int, phase: str) -> None:
        """A node's wave barrier counts as a step too (timed from the last arrival anywhere: conservative)."""
        self.clock.arrive[self.rank].append(time.perf_counter())
        super()._node_barrier(local_rank, local_world_size, phase)
        now, cpu = time.perf_counter(), time.thread_time()
        self.clock.leave[self.rank].append(now)
        self.clock.woke[self.rank].append(now)
        self.clock.cpu[self.rank].append((cpu, cpu))


def _timed_leave(name: str) -> Callable[..., Any]:
    """``ThreadCoordinator.<name>`` that also records when the rank leaves the step."""
    real = getattr(ThreadCoordinator, name)

    def method(self: TimedCoordinator, *args: Any, **kwargs: Any) -> Any:
        try:
            return real(self, *args, **kwargs)
        finally:
            if self.distributed and len(self.clock.leave[self.rank]) < len(self.clock.arrive[self.rank]):
                self.clock.leave[self.rank].append(time.perf_counter())
                cpu = time.thread_time()
                self.clock.cpu[self.rank].append((getattr(self, "_cpu_woke", cpu), cpu))

    return method


for _name in (
    "master_computes", "master_computes_and_scatters", "gather_to_master_and_master_computes",
    "gather_and_master_computes", "run_all", "barrier", "all_gather_object", "broadcast_object",
    "gather_object", "scatter_object",
):  # fmt: skip
    setattr(TimedCoordinator, _name, _timed_leave(_name))


def _instrument_commit(clock: _Clock) -> None:
    """Record the commit's arrivals, rank 0's 'all arrived' and 'published', and each rank's 'outcome known'."""
    barrier = commit_barrier.CommitBarrier

    def wrap(name: str, before: str | None, after: str | None) -> None:
        real = getattr(barrier, name)

        def method(self: commit_barrier.CommitBarrier, *args: Any, **kwargs: Any) -> Any:
            if before:
                clock.mark(self.seq, self.rank, before)
            result = real(self, *args, **kwargs)
            if after:
                clock.mark(self.seq, self.rank, after)
            return result

        setattr(barrier, name, method)

    wrap("arrive", "arrived", None)
    wrap("wait_all_arrived", None, "all_arrived")
    wrap("publish_outcome", "published", None)
    wrap("wait_outcome", None, "outcome")
