"""One simulated world: ``n`` thread ranks, their managers and the counting storage, and the figures of each
operation on it."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.suites.scale.clock import TimedCoordinator, _Clock, _instrument_commit
from benchmarks.suites.scale.output import print_row
from benchmarks.suites.scale.store import StoreProcess
from benchmarks.suites.scale.workload import (
    GET_RATE,
    PUT_RATE,
    RANKS_PER_NODE,
    READ_KINDS,
    WRITE_KINDS,
    layout_for,
    stage_state,
)
from nxd_ckpt.format import tags
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import RequestCountingStorage
from nxd_ckpt.testing.threadworld import ThreadWorld


class World:
    """``n`` thread ranks, their managers and the counting storage of one checkpoint directory."""

    def __init__(self, n: int, root: str, layers: int, elems: int, clock: _Clock, store: Any) -> None:
        self.n = n
        self.tp, self.pp, self.dp = layout_for(n)
        self.world = ThreadWorld(n, timeout_s=1800.0, count=True, store=store)
        self.clock = clock
        self.storage = RequestCountingStorage(LocalStorage(root))
        shared = Topology(tp_size=self.tp, pp_size=self.pp, dp_size=self.dp)  # groups built once, for every rank
        self.topos = [
            Topology(
                tp_size=self.tp,
                pp_size=self.pp,
                dp_size=self.dp,
                rank=r,
                local_rank=r % min(n, RANKS_PER_NODE),
                local_world_size=min(n, RANKS_PER_NODE),
                groups=shared.groups,
            )
            for r in range(n)
        ]
        self.managers = []
        for r in range(n):
            coord = TimedCoordinator(self.world, r)
            coord.clock = clock
            self.managers.append(CheckpointManager(coordinator=coord, topology=self.topos[r], storage=self._storage))
        self.states = [stage_state(t, layers, elems) for t in self.topos]

    def _storage(self, _directory: Any) -> RequestCountingStorage:
        return self.storage

    def measure(self, what: str, fn: Callable[[int], Any]) -> dict[str, Any]:
        """Run ``fn(rank)`` on every rank and return the figures of that one operation."""
        self.clock.reset()
        self.storage.reset()
        ops_before = [t.total() for t in self.world.tallies]
        wait_before = [t.total("waiting") for t in self.world.tallies]
        coll_before = [{k: list(v) for k, v in c.items()} for c in self.world.collectives]
        start = time.perf_counter()
        self.world.run(fn)
        wall = time.perf_counter() - start
        ops = [t.total() - b for t, b in zip(self.world.tallies, ops_before, strict=True)]
        waits = [t.total("waiting") - b for t, b in zip(self.world.tallies, wait_before, strict=True)]
        calls, received = [], []
        for now, before in zip(self.world.collectives, coll_before, strict=True):
            calls.append(sum(v[0] - before.get(k, [0, 0])[0] for k, v in now.items()))
            received.append(sum(v[1] - before.get(k, [0, 0])[1] for k, v in now.items()))
        coordination, critical, steps = self.clock.coordination_s()
        return {
            "op": what,
            "ranks": self.n,
            "layout": f"TP{self.tp} PP{self.pp} DP{self.dp}",
            "wall_s": wall,
            "coordination_s": coordination,
            "critical_s": critical,
            "parallel_s": self.clock.parallel_s(),
            "releases": self.clock.releases(),
            "steps": steps,
            "store_ops_mean": statistics.fmean(ops),
            "store_ops_max": max(ops),
            "store_wait_ops_max": max(waits),
            "collectives_max": max(calls),
            "recv_bytes_max": max(received),
            **_requests(self.storage),
        }


def _requests(storage: RequestCountingStorage) -> dict[str, Any]:
    """Files, bytes and requests of one operation, and their time at S3's per-prefix rates."""
    by_prefix = storage.by_prefix

    def seconds(counts: dict[str, int]) -> float:
        writes = sum(n for k, n in counts.items() if k in WRITE_KINDS)
        reads = sum(n for k, n in counts.items() if k in READ_KINDS)
        return writes / PUT_RATE + reads / GET_RATE

    busiest = max(by_prefix.items(), key=lambda kv: sum(kv[1].values()), default=("-", {}))
    return {
        "files": storage.files_written,
        "bytes": storage.bytes_written,
        "requests": dict(sorted(storage.requests.items())),
        "busiest_prefix": busiest[0],
        "busiest_prefix_requests": sum(busiest[1].values()),
        "s3_s_busiest_prefix": seconds(busiest[1]),
        "s3_s_one_prefix": seconds(storage.requests),
    }


def run_world(
    n: int, layers: int, elems: int, ops: list[str], root: str, num_workers: int, release_s: float
) -> list[dict[str, Any]]:
    """Every operation of ``ops`` on an ``n``-rank world: a row each (``release_s``: ``store_release_s(n)``)."""
    clock = _Clock(n)
    _instrument_commit(clock)
    with StoreProcess() as store:
        return _run_world(n, layers, elems, ops, root, num_workers, release_s, clock, store)


def _run_world(
    n: int, layers: int, elems: int, ops: list[str], root: str, num_workers: int, release_s: float, clock: _Clock,
    store: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """``run_world``'s body, on the store process it started: the first save, then each operation of ``ops``."""
    start = time.perf_counter()
    world = World(n, os.path.join(root, f"w{n}"), layers, elems, clock, store)
    print(f"  {n} ranks: world set up in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        row["release_s"] = release_s
        row["projected_s"] = row["critical_s"] + row["releases"] * release_s
        row["parallel_projected_s"] = row["parallel_s"] + row["releases"] * release_s
        print_row(row)
        rows.append(row)

    managers, states = world.managers, world.states
    directory = os.path.join(root, f"w{n}")

    def save(tag: str, async_save: bool) -> Callable[[int], None]:
        def fn(rank: int) -> None:
            model, optimizer = states[rank]
            managers[rank].save(
                directory, tag, model=model, optimizer=optimizer, zero1_optimizer=True, num_workers=num_workers,
                async_save=async_save, use_xser=True,
            )  # fmt: skip
            managers[rank].finalize()

        return fn

    record(world.measure("first save", save("s0", False)))  # + one-time setup: sessions, wait connections
    if "save" in ops:
        record(world.measure("save", save("s1", False)))
    if "async" in ops:
        world.measure("first async save", save("a0", True))  # the writer threads' one-time setup
        record(world.measure("async save", save("s2", True)))
    if "load" in ops:

        def load(rank: int) -> None:
            model, optimizer = states[rank]
            managers[rank].load(directory, None, model=model, optimizer=optimizer, num_workers=num_workers)

        try:
            record(world.measure("load", load))
        except NotImplementedError as e:
            print(f"  load at {n} ranks not simulated: {e}", file=sys.stderr)
    if "latest" in ops:
        record(world.measure("latest", lambda rank: tags.latest_tag(world.storage) if rank == 0 else None))
    world.world.close()
    shutil.rmtree(directory, ignore_errors=True)
    return rows
