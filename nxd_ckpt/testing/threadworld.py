"""A world of ranks as threads of one process, for single-process tests of the manager's policies.

``ThreadWorld(n)`` hands out ``n`` coordinators (``ThreadCoordinator``) whose collectives meet at
a condition variable instead of torch.distributed, and whose ``store`` is a real c10d TCPStore on 127.0.0.1
shared by all of them, so the commit protocol (``commit.CommitBarrier``) runs exactly as in a job. Inject one
per thread into ``CheckpointManager(coordinator=..., topology=...)`` and call ``run(fn)``.
DP replica subgroups are not modelled: use layouts without DP replicas for loads (save paths need none).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from nxd_ckpt.dist import coordinator as nxd_dist
from nxd_ckpt.dist.coordinator import Coordinator

T = TypeVar("T")


class ThreadWorld:
    """``size`` ranks as threads exchanging objects in lockstep, sharing one TCPStore."""

    def __init__(self, size: int, timeout_s: float = 120.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._slots: dict[int, dict[int, Any]] = {}
        self._calls = [0] * size
        self._exited: set[int] = set()
        self.store = nxd_dist.local_store(timeout_s)

    def coordinator(self, rank: int) -> ThreadCoordinator:
        return ThreadCoordinator(self, rank)

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(rank)`` on one thread per rank; returns the results in rank order, or raises the error of the
        lowest rank that failed (a rank left waiting for a failed one raises too, instead of hanging)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size
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

        threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
            if t.is_alive():
                raise TimeoutError(f"{t.name} did not finish within {self.timeout_s} s")
        primary = [e for e in errors if e is not None and not isinstance(e, _PeerExited)]
        if primary or any(errors):
            raise (primary or [e for e in errors if e is not None])[0]
        return results

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (the one primitive every collective here is built on): the n-th
        exchange of each rank meets the n-th of the others."""
        with self._cond:
            call = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(call, {})
            slot[rank] = obj
            self._cond.notify_all()

            def settled() -> bool:
                return len(slot) == self.size or any(self._calls[r] <= call for r in self._exited)

            if not self._cond.wait_for(settled, self.timeout_s):
                raise TimeoutError(f"rank {rank}: collective #{call} timed out after {self.timeout_s} s")
            if len(slot) < self.size:
                gone = sorted(r for r in self._exited if self._calls[r] <= call)
                raise _PeerExited(f"rank {rank}: rank(s) {gone} finished before collective #{call}")
            return [slot[r] for r in range(self.size)]


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
        return self.world.store if self.distributed else None

    def host_names(self) -> list[str]:
        return ["localhost"] * self.world_size  # one host: replicas share reads through the page cache

    def gather_object(self, obj: T, dst: int = 0, phase: str = "gathering") -> list[T] | None:
        self._arrive_and_wait(phase)
        out = self.world.exchange(self.rank, obj)
        return out if self.rank == dst else None

    def scatter_object(self, objs: list[T] | None, src: int = 0, phase: str = "scattering") -> T:
        self._arrive_and_wait(phase)
        return self.world.exchange(self.rank, objs)[src][self.rank]  # type: ignore[no-any-return]

    def subgroup(self, ranks: list[int]) -> Any:
        raise NotImplementedError("ThreadWorld does not model DP replica subgroups: use a layout without them")

    def broadcast_tensor(self, tensor: Any, src: int, group: Any) -> None:
        raise NotImplementedError("ThreadWorld does not model DP replica subgroups: use a layout without them")

    def _broadcast(self, obj: Any, src: int, group: Any | None) -> Any:
        self._whole_world(group)
        return self.world.exchange(self.rank, obj)[src]

    def _all_gather(self, obj: Any, group: Any | None) -> list[Any]:
        self._whole_world(group)
        return self.world.exchange(self.rank, obj)

    @staticmethod
    def _whole_world(group: Any | None) -> None:
        if group is not None:
            raise NotImplementedError("ThreadWorld collectives run over the whole world only")
