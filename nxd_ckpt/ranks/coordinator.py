"""The only module that talks to torch.distributed: the coordinator of every cross-rank step, with deadlines.

Modelled on DCP's ``_DistWrapper``: each step is one collective that carries exceptions, so a failure on any
rank is raised on every rank, as the same exception type, carrying the rank it came from (``origin_rank``).
"Rank 0 computes, every rank receives" is ``Coordinator.master_computes``; "every rank does its part, all
learn whether anyone failed" is ``Coordinator.run_all``. Without a process group every step just runs locally.

Deadlines: before a step's collective, every rank checks in on the c10d store and waits there for the others,
in a blocking ``wait`` on a connection of its own (``wait_for_key``), so its store operations per step are a
handful however long it waits. That wait has a deadline (``NXD_CKPT_TIMEOUT_S`` or the ``timeout=`` of the
call): while it runs the master logs which ranks have not arrived and in which phase, and past it every
waiting rank raises ``CheckpointTimeoutError`` naming the phase and the missing ranks, instead of sitting in
a collective until the process group's own timeout (30 minutes by default) with nothing logged. The
collective itself only starts once every rank is there. ``save/barrier.py`` uses the same store waits.

XLA collectives do not work across processes on XLA:CPU and gloo must never see XLA tensors, so every
exchange here is of Python objects or CPU tensors over a gloo group. When the default group is not gloo
(e.g. the ``xla`` backend on Neuron) a gloo group over the whole world is created (at the first collective,
once every rank arrived) and reused.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from nxd_ckpt.errors import CheckpointTimeoutError, RemoteRankError

logger = logging.getLogger("nxd_ckpt")

T = TypeVar("T")

TIMEOUT_ENV = "NXD_CKPT_TIMEOUT_S"
LEGACY_TIMEOUT_ENV = "NXD_CKPT_COMMIT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
MAX_STALL_S = 300.0
"""A storage call with no progress for min(deadline / 2, this) is a stall (see ``watchdog.py``)."""
_LOG_NAMES = 16
"""Missing ranks named in one "waiting for" log line (the error at the deadline names them all)."""
_FIRST_POLL_S = 0.001
"""First pause of a store that must be polled (no ``clone``); it doubles up to the log interval."""
_PREFIX = "nxd_ckpt/step"


# ----------------------------------------------------------------------------------------------- process state
def is_distributed() -> bool:
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


def local_store(timeout_s: float) -> Any:
    """A c10d TCPStore served by this process on 127.0.0.1 (a port the kernel picks): for ranks as threads.

    The server listens on an IPv4 socket made here. Left to itself, c10d listens on a dual-stack IPv6 socket,
    sees each client as ``::ffff:127.0.0.1``, and resolves that name (for a log line) on its one event-loop
    thread: ``/etc/hosts`` has no entry for it, so the resolver asks DNS, and where DNS drops a query (on a
    machine without a reachable name server, about one in 25 here) the whole store stalls 5 s per connection,
    so a world of 1,024 thread ranks took minutes to connect."""
    import socket

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


# ----------------------------------------------------------------------------------------------- deadlines
def default_timeout_s() -> float:
    """The deadline of every phase: ``NXD_CKPT_TIMEOUT_S`` (or the older ``NXD_CKPT_COMMIT_TIMEOUT_S``), default
    1800 s (``knobs.timeout_s``)."""
    from nxd_ckpt import knobs

    return knobs.timeout_s()


def resolve_timeout(timeout: float | None) -> float:
    """The deadline for one call: its ``timeout=`` if given, else ``default_timeout_s()``."""
    if timeout is None:
        return default_timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None for {TIMEOUT_ENV}), got {timeout!r}")
    return float(timeout)


def stall_limit_s(timeout_s: float) -> float:
    """Seconds without storage progress that count as a stall: half the deadline (so a call that stopped moving
    is told apart from one that only crawls), at most 5 minutes."""
    return min(timeout_s / 2, MAX_STALL_S)


def log_interval_s(timeout_s: float) -> float:
    """How often the master repeats "waiting for ranks ...": four times per deadline, at most every 30 s."""
    return min(30.0, max(0.25, timeout_s / 4))


def _ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


ARRIVAL_GROUP = 32
"""Ranks that share one arrival key (a node's worth): each sets its own bit with one ``add``, and only the last
of a group counts the group in at the step's shared counter, so a step costs the store about one operation per
rank for the arrivals, and its shared keys see one operation per group, not per rank."""
GAVE_UP = 1 << 40
"""Added to a step's counters by the rank that gave up waiting: a late rank's own ``add`` then tells it so, with
no extra store operation on the way of the ranks that are on time."""


def _group_size(group: int, world: int) -> int:
    return min(ARRIVAL_GROUP, world - group * ARRIVAL_GROUP)


def arrive(store: Any, prefix: str, rank: int, world: int) -> bool:
    """Check in at ``prefix`` on the store: one ``add`` of this rank's bit to its group's key; the group's last
    rank marks the group complete and counts it in, and the last group sets ``all_arrived_key(prefix)``, which
    the others wait for. True if a rank already gave up waiting at this step (this one is too late)."""
    group, bit = divmod(rank, ARRIVAL_GROUP)
    mask = int(store.add(f"{prefix}/g/{group}", 1 << bit))
    if mask >= GAVE_UP:
        return True
    if mask == (1 << _group_size(group, world)) - 1:
        store.set(f"{prefix}/c/{group}", b"1")
        complete = int(store.add(f"{prefix}/n", 1))
        if complete >= GAVE_UP:
            return True
        if complete == -(-world // ARRIVAL_GROUP):
            store.set(all_arrived_key(prefix), b"1")
    return False


def missing_ranks(store: Any, prefix: str, world: int, limit: int | None = None) -> list[int]:
    """Ranks that have not arrived at ``prefix`` (see ``arrive``), lowest first, at most ``limit`` of them. The
    incomplete groups are found by bisection (``check`` of many keys answers whether all exist), then one read
    of each one's bits: k missing ranks in g incomplete groups cost about 2g·log2(G/g) + g operations, not N."""
    found: list[int] = []

    def absent(lo: int, hi: int) -> None:
        if (limit is not None and len(found) >= limit) or store.check([f"{prefix}/c/{g}" for g in range(lo, hi)]):
            return
        if hi - lo == 1:
            mask = int(store.add(f"{prefix}/g/{lo}", 0)) % GAVE_UP
            first = lo * ARRIVAL_GROUP
            found.extend(first + b for b in range(_group_size(lo, world)) if not (mask >> b) & 1)
            return
        mid = (lo + hi) // 2
        absent(lo, mid)
        absent(mid, hi)

    if world > 0:
        absent(0, -(-world // ARRIVAL_GROUP))
    return found if limit is None else found[:limit]


def give_up(store: Any, prefix: str, rank: int, missing: list[int] | tuple[int, ...]) -> None:
    """After a deadline at ``prefix``: the first rank to give up tells the late ranks (their own ``add`` at
    arrival returns past ``GAVE_UP``) and names itself in ``<prefix>/gave_up``."""
    if store.add(f"{prefix}/gave_up_by", 1) != 1:
        return
    store.set(f"{prefix}/gave_up", str(rank).encode())
    store.add(f"{prefix}/n", GAVE_UP)
    for group in sorted({r // ARRIVAL_GROUP for r in missing}):
        store.add(f"{prefix}/g/{group}", GAVE_UP)


def forget_step(store: Any, prefix: str, rank: int) -> None:
    """Delete the keys of a finished step that ``rank`` owns: its group's (the group's first rank) and the
    shared ones (rank 0); so no rank's deletions grow with the number of ranks. (A step at which a rank gave
    up keeps its two ``gave_up`` keys: rare, and so nobody deletes two keys per step that almost never exist.)"""
    keys = []
    if rank % ARRIVAL_GROUP == 0:
        group = rank // ARRIVAL_GROUP
        keys += [f"{prefix}/g/{group}", f"{prefix}/c/{group}"]
    if rank == 0:
        keys += [f"{prefix}/n", all_arrived_key(prefix)]
    with contextlib.suppress(Exception):
        for key in keys:
            store.delete_key(key)


def all_arrived_key(prefix: str) -> str:
    """Set once every rank has arrived at ``prefix``."""
    return f"{prefix}/all"


class _Waiters(threading.local):
    """Per thread: a second connection to each store, for blocking waits (a wait holds its client's lock, so on
    the shared client it would stall the other thread, training or writer, that uses the store meanwhile)."""

    def __init__(self) -> None:
        self.clients: dict[int, tuple[Any, Any]] = {}


_waiters = _Waiters()


def waiting_client(store: Any) -> Any | None:
    """This thread's own connection to ``store`` for blocking waits (made once); None if the store cannot be
    cloned (then waits poll with back-off)."""
    entry = _waiters.clients.get(id(store))
    if entry is None or entry[0] is not store:
        try:
            clone = store.clone()
        except Exception:  # a store type without clone(): poll
            clone = None
        entry = (store, clone)
        _waiters.clients[id(store)] = entry
        while len(_waiters.clients) > _MAX_WAITERS:  # stores of process groups long destroyed: let them go
            del _waiters.clients[next(iter(_waiters.clients))]
    return entry[1]


_MAX_WAITERS = 8
"""Waiting connections kept per thread (one per store it waited on; a job has one store)."""


def _wait_once(store: Any, waiter: Any | None, key: str, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``key``: one blocking ``wait`` on this thread's own connection (one store
    operation however long it lasts), or without one a single ``check`` after sleeping; True once it is set."""
    if waiter is None:
        time.sleep(seconds)
        return bool(store.check([key]))
    import torch.distributed as dist

    try:
        waiter.wait([key], datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except dist.DistStoreError as e:
        if "timeout" not in str(e).lower():
            raise
        return False


def wait_for_key(
    store: Any,
    key: str,
    missing: Callable[[int | None], list[int]],
    phase: str,
    timeout_s: float,
    *,
    log: bool,
    since: float | None = None,
) -> None:
    """Block until ``key`` is set on ``store``; log who is ``missing(limit)`` every few seconds (if ``log``; the
    first few only, so a log line costs a bounded number of store operations); past ``timeout_s`` (counted from
    ``since``, default now) raise CheckpointTimeoutError naming them all.

    The number of store operations does not grow with the wait: a rank that does not log makes one blocking
    ``wait`` per deadline; one that logs wakes up once per log line (``log_interval_s``: at most about
    max(4, deadline / 30 s) times); a store without ``clone`` is polled with doubling pauses up to that interval.
    """
    start = time.monotonic() if since is None else since
    interval = log_interval_s(timeout_s)
    next_log = start + interval
    waiter = waiting_client(store)
    pause = _FIRST_POLL_S
    while True:
        now = time.monotonic()
        remaining = timeout_s - (now - start)
        if remaining <= 0:
            if store.check([key]):
                return
            late = missing(None)
            raise CheckpointTimeoutError(
                f"timed out after {timeout_s:g} s in phase '{phase}' waiting for rank(s) {_ranks_text(late)}; "
                f"those ranks are stuck or far behind (their own logs or errors say where). Raise {TIMEOUT_ENV} "
                "or pass a larger timeout= if they are only slow",
                phase=phase,
                missing_ranks=late,
            )
        if log and now >= next_log:
            names = missing(_LOG_NAMES + 1)
            more = " and more" if len(names) > _LOG_NAMES else ""
            logger.warning(
                "waiting for rank(s) %s%s in phase '%s' (%.1f s so far, deadline in %.1f s)",
                _ranks_text(names[:_LOG_NAMES]),
                more,
                phase,
                now - start,
                remaining,
            )
            next_log = now + interval
        step = min(remaining, next_log - now) if log else remaining
        if waiter is None:
            step, pause = min(step, pause), min(pause * 2, interval)
        if _wait_once(store, waiter, key, step):
            return


# ----------------------------------------------------------------------------------------------- failures
@dataclass(frozen=True)
class RankFailure:
    """An exception of one rank, in a form every rank can receive and raise again as the same type."""

    rank: int
    phase: str
    module: str
    qualname: str
    message: str
    attributes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, error: BaseException, rank: int, phase: str) -> RankFailure:
        origin = getattr(error, "origin_rank", None)
        attributes = {
            k: v
            for k, v in vars(error).items()
            if k in ("phase", "missing_ranks", "path", "bytes_moved") and isinstance(v, (str, int, tuple, type(None)))
        }
        return cls(
            rank=origin if isinstance(origin, int) else rank,
            phase=phase,
            module=type(error).__module__,
            qualname=type(error).__qualname__,
            message=str(error) or type(error).__name__,
            attributes=attributes,
        )

    def describe(self) -> str:
        return f"rank {self.rank} failed while {self.phase}: {self.qualname}: {self.message}"

    def to_exception(self, also_failed: list[int] | None = None) -> BaseException:
        """An exception of the original type (a RemoteRankError if it cannot be rebuilt here), whose message
        names the rank and phase, with ``origin_rank`` set."""
        others = f" (rank(s) {_ranks_text(also_failed)} failed too)" if also_failed else ""
        text = f"rank {self.rank} failed while {self.phase}: {self.message}{others}"
        error: BaseException
        try:
            cls: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                cls = getattr(cls, part)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                raise TypeError("not an Exception class")
            error = cls(text)
        except Exception:
            error = RemoteRankError(
                f"rank {self.rank} failed while {self.phase}: {self.qualname}: {self.message}{others}"
            )
        for name, value in self.attributes.items():
            with contextlib.suppress(Exception):
                setattr(error, name, value)
        with contextlib.suppress(Exception):
            error.origin_rank = self.rank  # type: ignore[attr-defined]
        return error


def mark_origin(error: BaseException, rank: int) -> None:
    """Record on ``error`` the rank it happened on (unless it already names one)."""
    if getattr(error, "origin_rank", None) is None:
        with contextlib.suppress(Exception):
            error.origin_rank = rank  # type: ignore[attr-defined]


def raise_failures(failures: list[RankFailure | None], local: BaseException | None, rank: int) -> None:
    """Raise on this rank what ``failures`` (one entry per rank, None where the step succeeded) say: the
    lowest failing rank's exception, as its own type, on every rank (the original object on that rank)."""
    failed = sorted((f for f in failures if f is not None), key=lambda f: f.rank)
    if not failed:
        if local is not None:  # cannot happen when the local failure was gathered; kept for safety
            raise local
        return
    first = failed[0]
    if local is not None and first.rank == rank:
        mark_origin(local, rank)
        raise local
    error = first.to_exception([f.rank for f in failed[1:]])
    if local is not None:
        raise error from local
    raise error


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


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
        self, obj: T, fn: Callable[[], Any], phase: str
    ) -> tuple[list[T] | None, Any]:
        """``gather_object(obj)`` to rank 0 and ``master_computes(fn)`` in one step: rank 0 receives every rank's
        ``obj`` (the others None) and every rank rank 0's result of ``fn`` (or its exception, raised everywhere as
        in ``master_computes``). Only rank 0 receives O(N) bytes; ``obj`` must hold CPU tensors only."""
        value, failure, local = self._on_master(fn, phase)
        if not self.distributed:
            if local is not None:
                raise local
            return [obj], value
        self._arrive_and_wait(phase)
        out = self._gather(obj, 0)
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
