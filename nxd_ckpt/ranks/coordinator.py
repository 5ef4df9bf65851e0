"""The only module that talks to torch.distributed: the world this process is in (``world_rank``,
``world_size``, ...) and the coordinator of every cross-rank step, with deadlines.

Modelled on DCP's ``_DistWrapper``: each step is one collective that carries exceptions (``failures.py``), so a
failure on any rank is raised on every rank, as the same exception type, carrying the rank it came from
(``origin_rank``). "Rank 0 computes, every rank receives" is ``Coordinator.master_computes``; "every rank does
its part, all learn whether anyone failed" is ``Coordinator.run_all``. Without a process group every step just
runs locally.

Deadlines: before a step's collective, every rank checks in on the c10d store and waits there for the others
(``arrivals.py``), under a deadline (``NXD_CKPT_TIMEOUT_S`` or the ``timeout=`` of the call, ``deadlines.py``):
past it every waiting rank raises ``CheckpointTimeoutError`` naming the phase and the missing ranks, instead of
sitting in a collective until the process group's own timeout (30 minutes by default) with nothing logged. The
collective itself only starts once every rank is there.

XLA collectives do not work across processes on XLA:CPU and gloo must never see XLA tensors, so every
exchange here is of Python objects or CPU tensors over a gloo group. When the default group is not gloo
(e.g. the ``xla`` backend on Neuron) a gloo group over the whole world is created (at the first collective,
once every rank arrived) and reused.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.ranks.arrivals import all_arrived_key, arrive, forget_step, give_up, missing_ranks, wait_for_key
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.ranks.failures import RankFailure, raise_failures

T = TypeVar("T")

_PREFIX = "nxd_ckpt/step"


# ----------------------------------------------------------------------------------------------- the world
def is_distributed() -> bool:
    """Whether a default process group is up."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's global rank (0 without a process group)."""
    import torch.distributed as dist

    return int(dist.get_rank()) if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if is_distributed() else 1


def backend() -> str | None:
    """The default process group's backend (``"gloo"``, ``"xla"``, ...), None without one."""
    import torch.distributed as dist

    return str(dist.get_backend()) if is_distributed() else None


def world_id() -> int | None:
    """Identifies the current default process group (None without one): changes when it is re-created."""
    import torch.distributed as dist

    return id(dist.group.WORLD) if is_distributed() else None


def group_identity() -> tuple[bool, int | None]:
    """Identifies the current default process group (a new ``init_process_group`` gives a new identity)."""
    return is_distributed(), world_id()


def new_gloo_group() -> Any:
    """A new gloo group over the whole world (every rank must call it), for collectives a background save runs
    beside training's own (DCP's ``async_save``); None without a process group."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if is_distributed() else None


def local_store(timeout_s: float) -> Any:
    """A c10d TCPStore served by this process on 127.0.0.1 (a port the kernel picks): for ranks as threads.

    The server listens on an IPv4 socket made here. Left to itself, c10d listens on a dual-stack IPv6 socket,
    sees each client as ``::ffff:127.0.0.1``, and resolves that name (for a log line) on its one event-loop
    thread: ``/etc/hosts`` has no entry for it, so the resolver asks DNS, and where DNS drops a query (on a
    machine without a reachable name server, about one in 25 here) the whole store stalls 5 s per connection,
    so a world of 1,024 thread ranks took minutes to connect."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(), use_libuv=True,
        )  # fmt: skip
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now
    return store


# ----------------------------------------------------------------------------------------------- the coordinator
class Coordinator:
    """Every cross-rank step of a save or load; a world of one when torch.distributed is not up.

    Collective methods must be called by every rank in the same order, from the thread that drives training,
    and every rank creates its coordinators in the same order (the n-th coordinator of each rank share the
    store keys of their steps). ``store`` is the exception: it is safe to use from a background thread.
    ``timeout_s`` is the deadline of each step (``deadline`` sets it for one call).
    """

    _created = 0

    def __init__(self, group: Any | None = None, timeout_s: float | None = None) -> None:
        self._set_up(is_distributed(), world_rank(), world_size(), timeout_s, group, own_group=group is not None)

    def _set_up(
        self, distributed: bool, rank: int, size: int, timeout_s: float | None, group: Any | None, own_group: bool
    ) -> None:
        """The coordinator's fields; a coordinator of another world (tests' ThreadCoordinator) sets them here too."""
        self.distributed = distributed
        self.rank = rank
        self.world_size = size
        self.timeout_s = resolve_timeout(timeout_s)
        self._group = group
        self._own_group = own_group
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self._session: str | None = None
        self._step = 0
        self._hosts: list[str] | None = None
        self._node_steps = 0

    # ------------------------------------------------------------------ plumbing
    @property
    def store(self) -> Any | None:
        """The c10d key-value store of the default process group (None in a world of one)."""
        if not self.distributed:
            return None
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    @property
    def session(self) -> str:
        """A name shared by the n-th coordinator of every rank (from the store, so no collective)."""
        if self._session is None:
            if self.store is None:
                Coordinator._created += 1
                self._session = f"local{Coordinator._created}"
            else:
                self._session = f"c{int(self.store.add(f'nxd_ckpt/coordinators/{self.rank}', 1))}"
        return self._session

    @property
    def group(self) -> Any | None:
        """The gloo group collectives run on (None = the default group, when it is gloo).

        Created on first use when the default backend is not gloo: every rank must reach that point.
        """
        if self.distributed and not self._own_group:
            import torch.distributed as dist

            if dist.get_backend() != "gloo":
                self._group = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=max(self.timeout_s, 60.0))
                )
            self._own_group = True
        return self._group

    @contextlib.contextmanager
    def deadline(self, timeout_s: float) -> Iterator[None]:
        """Use ``timeout_s`` as the deadline of every step inside the block."""
        previous, self.timeout_s = self.timeout_s, timeout_s
        try:
            yield
        finally:
            self.timeout_s = previous

    def _arrive_and_wait(self, phase: str) -> None:
        """Check in for the next step and wait (deadline, logs on the master) until every rank has."""
        store = self.store
        if store is None:
            return
        self._step += 1
        if self._step > 2:  # every rank has left the step before the last one: its keys go, before this wait
            forget_step(store, f"{_PREFIX}/{self.session}/{self._step - 2}", self.rank)
        prefix = f"{_PREFIX}/{self.session}/{self._step}"
        if arrive(store, prefix, self.rank, self.world_size):
            gave_up = int(store.get(f"{prefix}/gave_up"))
            raise CheckpointTimeoutError(
                f"rank {self.rank} reached phase '{phase}' after rank {gave_up} had given up waiting for it "
                f"(deadline {self.timeout_s:g} s): this rank was too late; see the error on the other ranks",
                phase=phase,
                missing_ranks=[self.rank],
            )
        try:
            wait_for_key(
                store,
                all_arrived_key(prefix),
                lambda limit: missing_ranks(store, prefix, self.world_size, limit),
                phase,
                self.timeout_s,
                log=self.rank == 0,
            )
        except CheckpointTimeoutError as e:
            give_up(store, prefix, self.rank, e.missing_ranks)
            e.origin_rank = self.rank
            raise

    # ------------------------------------------------------------------ steps that carry errors
    def master_computes(self, fn: Callable[[], T], phase: str) -> T:
        """Rank 0 runs ``fn``; every rank receives its result, or raises its exception (same type everywhere).

        One broadcast carries the result or the failure.
        """
        value, failure, local = self._on_master(fn, phase)
        if not self.distributed:
            if local is not None:
                raise local
            return value  # type: ignore[no-any-return]
        self._arrive_and_wait(phase)
        failure, value = self._broadcast((failure, value) if self.rank == 0 else None, 0, None)
        raise_failures([failure], local, self.rank)
        return value  # type: ignore[no-any-return]

    def master_computes_and_scatters(
        self, fn: Callable[[], tuple[T, list[Any] | None]], phase: str
    ) -> tuple[T, Any | None]:
        """Rank 0 runs ``fn`` for ``(common, parts)``; every rank receives ``common`` and its own ``parts[rank]``
        (None when ``parts`` is None), or raises rank 0's exception, as in ``master_computes``. One step: the
        broadcast (with the failure) and the scatter follow one arrival, as nothing runs between them; a rank
        receives ``common`` plus its own part, not everyone's."""

        def checked() -> tuple[T, list[Any] | None]:
            common, parts = fn()
            if parts is not None and len(parts) != self.world_size:
                raise ValueError(f"{phase}: {len(parts)} parts for a world of {self.world_size} ranks")
            return common, parts

        value, failure, local = self._on_master(checked, phase)
        if not self.distributed:
            if local is not None:
                raise local
            return value[0], None if value[1] is None else value[1][0]  # type: ignore[index]
        self._arrive_and_wait(phase)
        common, parts = value if value is not None else (None, None)
        failure, common, scattered = self._broadcast((failure, common, parts is not None), 0, None)
        raise_failures([failure], local, self.rank)
        return common, self._scatter(parts, 0) if scattered else None

    def gather_to_master_and_master_computes(
        self, obj: T, fn: Callable[[], Any], phase: str, agree: Callable[[list[T]], Any] | None = None
    ) -> tuple[list[T] | None, Any]:
        """``gather_object(obj)`` to rank 0 and ``master_computes(fn)`` in one step: rank 0 receives every rank's
        ``obj`` (the others None) and every rank rank 0's result of ``fn`` (or its exception, raised everywhere as
        in ``master_computes``). Only rank 0 receives O(N) bytes; ``obj`` must hold CPU tensors only. With
        ``agree``, rank 0 first reduces the gathered objects (``agree(objs)``: quick, a minimum say, or a check
        that refuses the step) and runs ``fn`` only if that succeeded; every rank receives ``(fn's result,
        agree's)`` in the same broadcast: no further round."""
        if not self.distributed:
            agreed = agree([obj]) if agree is not None else None
            value, _, local = self._on_master(fn, phase)
            if local is not None:
                raise local
            return [obj], value if agree is None else (value, agreed)
        if agree is None:
            value, failure, local = self._on_master(fn, phase)  # rank 0 works while the others arrive
        self._arrive_and_wait(phase)
        out = self._gather(obj, 0)
        if agree is not None:
            value, failure, local = None, None, None
            if self.rank == 0:
                assert out is not None
                agreed, failure, local = self._on_master(lambda: agree(out), phase)
                if failure is None:
                    value, failure, local = self._on_master(fn, phase)
                value = (value, agreed)
        failure, value = self._broadcast((failure, value) if self.rank == 0 else None, 0, None)
        raise_failures([failure], local, self.rank)
        return out, value

    def gather_and_master_computes(self, obj: T, fn: Callable[[], Any], phase: str) -> tuple[list[T], Any]:
        """``all_gather_object(obj)`` and ``master_computes(fn)`` in one step: rank 0's result of ``fn`` (or its
        exception, raised on every rank as in ``master_computes``) travels with its ``obj``."""
        value, failure, local = self._on_master(fn, phase)
        if not self.distributed:
            if local is not None:
                raise local
            return [obj], value
        gathered = self.all_gather_object((obj, failure, value), phase=phase)
        _, failure, value = gathered[0]
        raise_failures([failure], local, self.rank)
        return [mine for mine, _, _ in gathered], value

    def _on_master(self, fn: Callable[[], Any], phase: str) -> tuple[Any, RankFailure | None, BaseException | None]:
        """Rank 0: (``fn``'s result, None, None), or (None, its failure to send, the exception itself); other
        ranks: (None, None, None)."""
        if self.rank != 0:
            return None, None, None
        try:
            return fn(), None, None
        except BaseException as e:
            return None, RankFailure.of(e, 0, phase), e

    def run_all(self, fn: Callable[[], T], phase: str) -> T:
        """Every rank runs ``fn``; if it fails anywhere, every rank raises the (lowest) failing rank's exception
        as its own type. A one-number all-reduce says whether any rank failed (O(N) bytes in all); only then an
        all-gather carries the failures."""
        result: Any = None
        local: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:
            local = e
        if not self.distributed:
            if local is not None:
                raise local
            return result  # type: ignore[no-any-return]
        self._arrive_and_wait(phase)
        if self._any_failed(local is not None):  # the objects travel only when something failed
            failures = self._all_gather(None if local is None else RankFailure.of(local, self.rank, phase), None)
            raise_failures(failures, local, self.rank)
        return result  # type: ignore[no-any-return]

    def in_waves(
        self, limit: int, local_rank: int, local_world_size: int, fn: Callable[[], T], what: str, check: bool = True
    ) -> T:
        """Run ``fn`` with at most ``limit`` ranks of one host at a time (bounds host memory), then check errors.

        The waves are a concern of each host, so between waves only the ranks of one host wait for each other
        (``_node_barrier``; none after the last wave). One world-wide step at the end carries the failures;
        ``check=False`` leaves that to the caller's next cross-rank step (a save's commit carries them), and
        raises only this rank's own error."""
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
            if self.distributed and wave < waves - 1:
                self._node_barrier(local_rank, local_world_size, f"{what} (wave {wave + 1} of {waves})")

        def _report() -> Any:
            if error is not None:
                raise error
            return result

        return self.run_all(_report, what) if check else _report()  # type: ignore[no-any-return]

    def _node_barrier(self, local_rank: int, local_world_size: int, phase: str) -> None:
        """Wait (deadline, logs on the host's first rank) until every rank of this host reached this point. Hosts
        are ``rank // local_world_size`` (torchrun's numbering); their ranks name themselves by global rank."""
        store = self.store
        if store is None:
            return
        node = self.rank // local_world_size
        self._node_steps += 1
        prefix = f"{_PREFIX}/{self.session}/node{node}/{self._node_steps}"
        arrive(store, prefix, local_rank, local_world_size)
        first = node * local_world_size
        try:
            wait_for_key(
                store,
                all_arrived_key(prefix),
                lambda limit: [first + r for r in missing_ranks(store, prefix, local_world_size, limit)],
                phase,
                self.timeout_s,
                log=local_rank == 0,
            )
        except CheckpointTimeoutError as e:
            e.origin_rank = self.rank
            raise
        if self._node_steps > 2:
            forget_step(store, f"{_PREFIX}/{self.session}/node{node}/{self._node_steps - 2}", local_rank)

    # ------------------------------------------------------------------ plain exchanges (deadline-guarded)
    def barrier(self, phase: str = "barrier") -> None:
        """Wait until every rank reached this point (on the store: deadline and logs, no collective)."""
        self._arrive_and_wait(phase)

    def all_gather_object(self, obj: T, group: Any | None = None, phase: str = "exchanging") -> list[T]:
        """Every rank's ``obj`` in rank order within ``group`` (default: the whole world, deadline-guarded)."""
        if not self.distributed:
            return [obj]
        if group is None:
            self._arrive_and_wait(phase)
        return self._all_gather(obj, group)

    def broadcast_object(self, obj: T, src: int = 0, group: Any | None = None, phase: str = "exchanging") -> T:
        """``obj`` of global rank ``src``, on every rank of ``group`` (default: the whole world, deadline-guarded)."""
        if not self.distributed:
            return obj
        if group is None:
            self._arrive_and_wait(phase)
        return self._broadcast(obj, src, group)  # type: ignore[no-any-return]

    def gather_object(self, obj: T, dst: int = 0, phase: str = "gathering") -> list[T] | None:
        """Every rank's ``obj`` as a list on rank ``dst`` (None elsewhere); objects must hold CPU tensors only."""
        if not self.distributed:
            return [obj]
        self._arrive_and_wait(phase)
        return self._gather(obj, dst)

    def scatter_object(self, objs: list[T] | None, src: int = 0, phase: str = "scattering") -> T:
        """Rank ``r`` receives ``objs[r]`` from rank ``src`` (``objs`` is read on ``src`` only)."""
        if not self.distributed:
            if objs is None or len(objs) != 1:
                raise ValueError("scatter_object in a world of one needs a list of exactly one object")
            return objs[0]
        self._arrive_and_wait(phase)
        return self._scatter(objs, src)  # type: ignore[no-any-return]

    def host_names(self) -> list[str]:
        """Every rank's host name, by rank (gathered once)."""
        if self._hosts is None:
            self._hosts = self.all_gather_object(socket.gethostname(), phase="exchanging host names")
        return self._hosts

    def all_gather_with_hosts(self, obj: T, phase: str) -> list[T]:
        """``all_gather_object(obj)``, carrying the host names along when they are not known yet (one step, where
        ``host_names`` first would take two)."""
        if self._hosts is not None or not self.distributed:
            return self.all_gather_object(obj, phase=phase)
        pairs = self.all_gather_object((socket.gethostname(), obj), phase=phase)
        self._hosts = [host for host, _ in pairs]
        return [value for _, value in pairs]

    # ------------------------------------------------------------------ subgroups
    def subgroup(self, ranks: list[int]) -> Any:
        """A gloo group over ``ranks``; every rank must request every subgroup in the same order."""
        key = tuple(ranks)
        if key not in self._subgroups:
            import torch.distributed as dist

            self._subgroups[key] = dist.new_group(
                ranks=list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=max(self.timeout_s, 60.0))
            )
        return self._subgroups[key]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Broadcast a CPU tensor in place within ``group`` (``src`` is a global rank)."""
        if tensor.device.type != "cpu":
            raise ValueError("only CPU tensors may be exchanged between ranks (gloo); got " + str(tensor.device))
        import torch.distributed as dist

        dist.broadcast(tensor, src=src, group=group)

    # ------------------------------------------------------------------ raw collectives
    def _broadcast(self, obj: Any, src: int, group: Any | None) -> Any:
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=group if group is not None else self.group)
        return box[0]

    def _gather(self, obj: Any, dst: int) -> list[Any] | None:
        """Every rank's ``obj`` as a list on ``dst`` (None elsewhere), over the whole world."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out

    def _scatter(self, objs: list[Any] | None, src: int) -> Any:
        """``objs[rank]`` from ``src`` (read there only), over the whole world."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == src else None, src=src, group=self.group)
        return box[0]

    def _any_failed(self, failed: bool) -> bool:
        """Whether ``failed`` holds on any rank of the world: a MAX all-reduce of one integer."""
        import torch.distributed as dist

        flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _all_gather(self, obj: Any, group: Any | None) -> list[Any]:
        import torch.distributed as dist

        size = self.world_size if group is None else dist.get_world_size(group)
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group if group is not None else self.group)
        return out
