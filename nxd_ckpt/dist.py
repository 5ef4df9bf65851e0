"""The only module that talks to torch.distributed: collectives on CPU objects and the c10d store.

XLA collectives do not work across processes on XLA:CPU and gloo must never see XLA tensors, so every
exchange here is of Python objects or CPU tensors over a gloo group. When the default group is not gloo
(e.g. the ``xla`` backend on Neuron) a gloo group over the whole world is created once and reused.
"""

from __future__ import annotations

import datetime
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import RemoteRankError

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_store(timeout_s: float) -> Any:
    """A c10d TCPStore served by this process on 127.0.0.1 (any free port): for tests that run ranks as threads."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=timeout_s))


def group_identity() -> tuple[bool, int | None]:
    """Identifies the current default process group (a new ``init_process_group`` gives a new identity)."""
    initialized = is_distributed()
    return initialized, id(dist.group.WORLD) if initialized else None


class Coordinator:
    """Rank-aware helper for collective checkpoint steps; a world of one when torch.distributed is not up.

    Collective methods must be called by every rank in the same order, from the thread that drives training.
    ``store`` is the exception: it is safe to use from a background thread.
    """

    def __init__(self, group: Any | None = None) -> None:
        self.distributed = is_distributed()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._group = group
        if self.distributed and group is None and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")
        self._subgroups: dict[tuple[int, ...], Any] = {}

    @property
    def group(self) -> Any | None:
        return self._group

    @property
    def store(self) -> Any | None:
        """The c10d key-value store of the default process group (None in a world of one)."""
        if not self.distributed:
            return None
        return dist.distributed_c10d._get_default_store()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._group)

    def broadcast_object(self, obj: T, src: int = 0, group: Any | None = None) -> T:
        """``obj`` of global rank ``src``, on every rank of ``group`` (default: the whole world)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=group if group is not None else self._group)
        return box[0]  # type: ignore[return-value]

    def all_gather_object(self, obj: T, group: Any | None = None) -> list[T]:
        """Every rank's ``obj`` in rank order within ``group`` (default: the whole world)."""
        if not self.distributed:
            return [obj]
        size = self.world_size if group is None else dist.get_world_size(group)
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group if group is not None else self._group)
        return out

    def gather_object(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` as a list on rank ``dst`` (None elsewhere); objects must hold CPU tensors only."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self._group)
        return out

    def scatter_object(self, objs: list[T] | None, src: int = 0) -> T:
        """Rank ``r`` receives ``objs[r]`` from rank ``src`` (``objs`` is read on ``src`` only)."""
        if not self.distributed:
            if objs is None or len(objs) != 1:
                raise ValueError("scatter_object in a world of one needs a list of exactly one object")
            return objs[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == src else None, src=src, group=self._group)
        return box[0]  # type: ignore[no-any-return]

    def subgroup(self, ranks: list[int]) -> Any:
        """A gloo group over ``ranks``; every rank must request every subgroup in the same order."""
        key = tuple(ranks)
        if key not in self._subgroups:
            self._subgroups[key] = dist.new_group(ranks=list(ranks), backend="gloo")
        return self._subgroups[key]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Broadcast a CPU tensor in place within ``group`` (``src`` is a global rank)."""
        if tensor.device.type != "cpu":
            raise ValueError("only CPU tensors may be exchanged between ranks (gloo); got " + str(tensor.device))
        dist.broadcast(tensor, src=src, group=group)

    def run_all(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise on every rank (naming the failed ranks).

        The local exception is re-raised as is; ranks whose own step succeeded raise RemoteRankError.
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except BaseException as e:
            error = e
        if self.distributed:
            report = None if error is None else f"{type(error).__name__}: {error}"
            reports = self.all_gather_object(report)
            failed = {r: msg for r, msg in enumerate(reports) if msg is not None}
        else:
            failed = {}
        if error is not None:
            raise error
        if failed:
            first = min(failed)
            raise RemoteRankError(f"{what} failed on rank(s) {sorted(failed)}; rank {first}: {failed[first]}")
        return result  # type: ignore[no-any-return]

    def in_waves(self, limit: int, local_rank: int, local_world_size: int, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` with at most ``limit`` ranks of one host at a time (bounds host memory), then check errors."""
        limit = max(1, int(limit))
        waves = -(-local_world_size // limit)
        my_wave = local_rank // limit
        error: BaseException | None = None
        result: Any = None
        for wave in range(waves if self.distributed else 1):
            if wave == my_wave or not self.distributed:
                try:
                    result = fn()
                except BaseException as e:
                    error = e
            if self.distributed and waves > 1:
                self.barrier()

        def _report() -> Any:
            if error is not None:
                raise error
            return result

        return self.run_all(_report, what)


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def store_timeout() -> datetime.timedelta:
    """How long commit steps wait for other ranks (NXD_CKPT_COMMIT_TIMEOUT_S, default 30 minutes)."""
    from . import knobs

    return datetime.timedelta(seconds=knobs.commit_timeout_s())
