"""Arrivals on the c10d store: every rank checks in at a step (``arrive``), and waits there, under a deadline,
until all have (``wait_for_key``), learning who is missing (``missing_ranks``) without store operations that
grow with the number of ranks or with the wait.

A rank waits in a blocking ``wait`` on a connection of its own (``waiting_client``), so its store operations
per step are a handful however long it waits. While it waits the master logs which ranks have not arrived
and in which phase; past the deadline every waiting rank raises ``CheckpointTimeoutError`` naming the phase
and the missing ranks. The coordinator's steps (``coordinator.py``) and a save's commit (``save/commit.py``)
both wait here, on the store the coordinator hands them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.ranks.deadlines import TIMEOUT_ENV, log_interval_s
from nxd_ckpt.ranks.failures import ranks_text

logger = logging.getLogger("nxd_ckpt")

_LOG_NAMES = 16
"""Missing ranks named in one "waiting for" log line (the error at the deadline names them all)."""
_FIRST_POLL_S = 0.001
"""First pause of a store that must be polled (no ``clone``); it doubles up to the log interval."""
_STORE_ERROR: type[Exception] = torch._C._DistStoreError
"""What a c10d store's ``wait`` raises at its timeout (re-exported as ``torch.distributed.DistStoreError``):
named here through ``torch._C`` as only ``coordinator.py`` imports torch.distributed."""


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
    try:
        waiter.wait([key], datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except _STORE_ERROR as e:
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
                f"timed out after {timeout_s:g} s in phase '{phase}' waiting for rank(s) {ranks_text(late)}; "
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
                ranks_text(names[:_LOG_NAMES]),
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
