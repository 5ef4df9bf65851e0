"""A world of ranks as threads of one process, for single-process tests of the manager's policies.

``ThreadWorld(n)`` hands out ``n`` coordinators (``ThreadCoordinator``) whose collectives meet at
a condition variable instead of torch.distributed, and whose ``store`` is a real c10d TCPStore on 127.0.0.1
shared by all of them, so the commit barrier (``save.barrier.CommitBarrier``) runs exactly as in a job. Inject one
per thread into ``CheckpointManager(coordinator=..., topology=...)`` and call ``run(fn)``.
DP replica subgroups are not modelled: use layouts without DP replicas for loads (save paths need none).

``count=True`` instruments the world for the scale benchmark and the store-operation tests: each rank's store
is a ``testing.counting.CountingStore`` over a connection of its own (``tallies[rank]``), and
``collectives[rank]`` counts that rank's collectives by kind with the bytes gloo would make it receive (objects
pickled; an all-gather pads every object to the largest, as ``all_gather_object`` does, and so does a scatter).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from nxd_ckpt.ranks import coordinator as nxd_dist
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.testing.counting import CountingStore, StoreTally

T = TypeVar("T")


def connect(store: Any, count: int) -> list[Any]:
    """``count`` new connections to ``store``, made 64 at a time: a client resolves the store's address for a
    log line as it connects, and where DNS drops that query (no reachable name server) the connection waits 5 s
    for it; one after another, 1,024 of them took minutes."""
    if count == 0:
        return []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(64, count), thread_name_prefix="nxd_ckpt_connect") as pool:
        return list(pool.map(lambda _: store.clone(), range(count)))


class ThreadWorld:
    """``size`` ranks as threads exchanging objects in lockstep, sharing one TCPStore."""

    def __init__(self, size: int, timeout_s: float = 120.0, count: bool = False, store: Any | None = None) -> None:
        """``store``: a client of a TCPStore served elsewhere (default: one served by this process). The scale
        benchmark serves it from another process: thousands of ranks' connections then count once, not twice
        (client and server socket), against this process's open files."""
        self.size = size
        self.timeout_s = timeout_s
        self.count = count
        self._cond = threading.Condition()
        self._slots: dict[int, dict[int, Any]] = {}
        self._met: dict[int, _Meeting] = {}
        self._calls = [0] * size
        self._exited: set[int] = set()
        self._workers: list[_RankThread] = []
        self.store = store if store is not None else nxd_dist.local_store(timeout_s)
        self.tallies = [StoreTally() for _ in range(size)] if count else []
        # with count=True every rank has its own connection, as a process has (not one client's lock for all)
        clients = connect(self.store, len(self.tallies))
        self._rank_stores = [CountingStore(c, t) for c, t in zip(clients, self.tallies, strict=True)]
        self.collectives: list[dict[str, list[int]]] = [{} for _ in range(size)] if count else []

    def rank_store(self, rank: int) -> Any:
        """The store client rank ``rank`` uses (a counting one with ``count=True``)."""
        return self._rank_stores[rank] if self.count else self.store

    def _account(self, rank: int, kind: str, src: int, met: _Meeting) -> None:
        """Record one collective of ``rank``: [calls, bytes received] under ``kind`` (O(1) per rank)."""
        received = {
            "all_gather": (self.size - 1) * met.largest,
            "broadcast": 0 if rank == src else met.sizes[src],
            "gather": met.total - met.sizes[src] if rank == src else 0,
            "scatter": 0 if rank == src else met.sizes[src],  # the largest object: each is padded to it
            "all_reduce": 4,
        }[kind]
        entry = self.collectives[rank].setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += received

    def coordinator(self, rank: int) -> ThreadCoordinator:
        return ThreadCoordinator(self, rank)

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(rank)`` on one thread per rank; returns the results in rank order, or raises the error of the
        lowest rank that failed (a rank left waiting for a failed one raises too, instead of hanging).

        Each rank keeps its thread from one ``run`` to the next, as a process keeps its training thread (so
        per-thread state, such as a rank's own store connection for waits, is made once, not per call)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size
        done = threading.Semaphore(0)
        with self._cond:
            self._exited.clear()

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:
                errors[rank] = e
            finally:
                with self._cond:
                    self._exited.add(rank)
                    self._cond.notify_all()
                done.release()

        if not self._workers:
            self._workers = [_RankThread(r) for r in range(self.size)]
        for worker in self._workers:
            worker.jobs.put(main)
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.size):
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                stuck = sorted(set(range(self.size)) - self._exited)
                raise TimeoutError(f"rank(s) {stuck} did not finish within {self.timeout_s} s")
        primary = [e for e in errors if e is not None and not isinstance(e, _PeerExited)]
        if primary or any(errors):
            raise (primary or [e for e in errors if e is not None])[0]
        return results

    def close(self) -> None:
        """End the rank threads (they end by themselves with the process too: daemons)."""
        for worker in self._workers:
            worker.jobs.put(None)
        self._workers = []

    def exchange(self, rank: int, obj: Any, kind: str = "all_gather", src: int = 0) -> list[Any]:
        """Every rank's ``obj`` in rank order (the one primitive every collective here is built on): the n-th
        exchange of each rank meets the n-th of the others. ``kind`` and ``src`` say which collective it stands
        for (for ``count=True``). The list is built once, by the last arrival, and shared: callers must not
        change it (an O(N) copy per rank would make the simulation, not the library, O(N²) per exchange)."""
        return self._meet(rank, obj, kind, src).objects

    @staticmethod
    def _pickled_size(obj: Any, kind: str) -> int:
        """The bytes gloo carries for ``obj``: pickled; for the source of a scatter the largest of its objects
        (``scatter_object_list`` pads every rank's object to it; the other ranks pass None)."""
        if kind == "all_reduce":
            return 0
        if kind == "scatter":
            return max((len(pickle.dumps(o)) for o in obj), default=0) if obj is not None else 0
        return len(pickle.dumps(obj))

    def flag(self, rank: int, value: bool) -> bool:
        """Whether ``value`` holds on any rank: a one-number all-reduce (computed once, by the last arrival)."""
        return self._meet(rank, value, "all_reduce", 0).any_true

    def _meet(self, rank: int, obj: Any, kind: str, src: int) -> _Meeting:
        """The n-th exchange of ``rank``, once every rank has reached its n-th."""
        size = self._pickled_size(obj, kind) if self.count else 0
        with self._cond:
            call = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(call, {})
            slot[rank] = (obj, size)
            if len(slot) == self.size:  # the last arrival builds the result and wakes the others
                objects, sizes = [slot[r][0] for r in range(self.size)], [slot[r][1] for r in range(self.size)]
                self._met[call] = _Meeting(objects, sizes, reduce=kind == "all_reduce")
                del self._slots[call]
                self._cond.notify_all()

            def settled() -> bool:
                return call in self._met or any(self._calls[r] <= call for r in self._exited)

            if not self._cond.wait_for(settled, self.timeout_s):
                raise TimeoutError(f"rank {rank}: collective #{call} timed out after {self.timeout_s} s")
            met = self._met.get(call)
            if met is None:
                gone = sorted(r for r in self._exited if self._calls[r] <= call)
                raise _PeerExited(f"rank {rank}: rank(s) {gone} finished before collective #{call}")
            met.readers += 1
            if met.readers == self.size:
                del self._met[call]
        if self.count:
            self._account(rank, kind, src, met)
        return met


class _Meeting:
    """The outcome of one exchange, built once by its last arrival: the objects and their pickled sizes."""

    def __init__(self, objects: list[Any], sizes: list[int], reduce: bool) -> None:
        self.objects = objects
        self.sizes = sizes
        self.largest = max(sizes, default=0)
        self.total = sum(sizes)
        self.any_true = reduce and any(objects)
        self.readers = 0


class _RankThread(threading.Thread):
    """The thread of one rank: runs the jobs ``ThreadWorld.run`` gives it, one after another."""

    def __init__(self, rank: int) -> None:
        super().__init__(name=f"rank{rank}", daemon=True)
        self.rank = rank
        self.jobs: queue.SimpleQueue[Callable[[int], None] | None] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job(self.rank)


class _PeerExited(RuntimeError):
    """A collective could not complete because another rank's function already returned or raised."""


class ThreadCoordinator(Coordinator):
    """``dist.Coordinator`` for one rank of a ThreadWorld: the same steps, deadlines and failure carrying (the
    store waits run on the world's real TCPStore), with threads exchanging objects instead of gloo."""

    def __init__(self, world: ThreadWorld, rank: int, timeout_s: float | None = None) -> None:
        # no torch.distributed involved: the fields Coordinator.__init__ would read from it come from the world
        self.world = world
        timeout = timeout_s if timeout_s is not None else world.timeout_s
        self._set_up(world.size > 1, rank, world.size, timeout, None, own_group=True)

    @property
    def store(self) -> Any | None:
        return self.world.rank_store(self.rank) if self.distributed else None

    def host_names(self) -> list[str]:
        return ["localhost"] * self.world_size  # one host: replicas share reads through the page cache

    def _gather(self, obj: Any, dst: int) -> list[Any] | None:
        out = self.world.exchange(self.rank, obj, "gather", dst)
        return list(out) if self.rank == dst else None

    def _scatter(self, objs: list[Any] | None, src: int) -> Any:
        return self.world.exchange(self.rank, objs if self.rank == src else None, "scatter", src)[src][self.rank]

    def subgroup(self, ranks: list[int]) -> Any:
        raise NotImplementedError("ThreadWorld does not model DP replica subgroups: use a layout without them")

    def broadcast_tensor(self, tensor: Any, src: int, group: Any) -> None:
        raise NotImplementedError("ThreadWorld does not model DP replica subgroups: use a layout without them")

    def _broadcast(self, obj: Any, src: int, group: Any | None) -> Any:
        self._whole_world(group)
        return self.world.exchange(self.rank, obj, "broadcast", src)[src]

    def _all_gather(self, obj: Any, group: Any | None) -> list[Any]:
        self._whole_world(group)
        return list(self.world.exchange(self.rank, obj))  # the caller's own list (a copy in C: cheap)

    def _any_failed(self, failed: bool) -> bool:
        return self.world.flag(self.rank, failed)

    @staticmethod
    def _whole_world(group: Any | None) -> None:
        if group is not None:
            raise NotImplementedError("ThreadWorld collectives run over the whole world only")
