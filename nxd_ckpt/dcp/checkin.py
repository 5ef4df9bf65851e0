"""One commit round of a DCP save: each rank's file records reach the coordinator in its ``WriteResult``s (DCP's
own gather), and the coordinator's deadline on the ranks' writes runs beside that gather, never in its way.

Each rank checks in on the c10d store (``ranks.arrivals``) when its ``write_data`` ends, written or failed. The
coordinator watches the check-ins on a thread (``WrittenCheckIn.watch``) while its own thread goes on into DCP's
gather, so a rank that fails anywhere in the save, before its ``write_data`` too, reaches every rank through
DCP's gather at once (a ``CheckpointException`` naming it), not at the deadline. Past the deadline the watch
names the ranks that never checked in (logged), and a rank checking in later is told so by its own check-in and
fails the save naming them (``CheckpointTimeoutError``): a save whose ranks missed the deadline is not committed.
A world of one (no process group) has nothing to wait for.

``check_recorded`` is the coordinator's check, from the gathered records alone (no storage request), that every
rank reported its files and every byte ``.metadata`` points at was recorded as written.
"""

from __future__ import annotations

import logging
import threading

from nxd_ckpt.errors import CheckpointError, CheckpointTimeoutError
from nxd_ckpt.format.manifests import FileRecord
from nxd_ckpt.ranks.arrivals import (
    ARRIVAL_GROUP,
    all_arrived_key,
    arrive,
    forget_step,
    give_up,
    missing_ranks,
    wait_for_key,
)
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.failures import ranks_text

logger = logging.getLogger("nxd_ckpt")

_PREFIX = "nxd_ckpt/dcp/written"
_WATCHES: list[_Watch] = []
"""The coordinator's watch of its latest save (at most one: a process's saves do not overlap)."""
_WATCHES_LOCK = threading.Lock()


class WrittenCheckIn:
    """The check-in of one save's ranks (``key``: the save's id, the same on every rank)."""

    def __init__(self, key: str, rank: int, world_size: int) -> None:
        self.prefix = f"{_PREFIX}/{key}"
        self.rank = rank
        self.world_size = world_size
        self.store = Coordinator().store if world_size > 1 else None
        self._watch: _Watch | None = None

    def check_in(self) -> None:
        """This rank's ``write_data`` has ended (its files and manifest are durable, or it failed).
        CheckpointTimeoutError (the coordinator's, naming every late rank) when the coordinator's deadline
        passed first: the save is not committed."""
        if self.store is None or not arrive(self.store, self.prefix, self.rank, self.world_size):
            return
        try:
            verdict = self.store.get(_verdict_key(self.prefix)).decode()
        except Exception:  # the coordinator's verdict is set before it gives up; a store gone says nothing
            verdict = f"rank {self.rank} finished writing after the coordinator's deadline"
        raise CheckpointTimeoutError(f"{verdict} (rank {self.rank} arrived late)", missing_ranks=(self.rank,))

    def watch(self, what: str, timeout_s: float) -> None:
        """Coordinator, once its own files are written: wait on a thread, under ``timeout_s``, for every rank's
        check-in (``what`` names the checkpoint). The thread deletes the save's keys once all are in; past the
        deadline it logs the missing ranks and tells them (their check-in then fails the save)."""
        if self.store is None:
            return
        with _WATCHES_LOCK:  # an earlier save's watch still running belongs to a save that failed: end it
            for earlier in _WATCHES:
                earlier.end()
            watch = _Watch(self, f"committing {what}: waiting for every rank's files", timeout_s)
            _WATCHES[:] = [watch]
        self._watch = watch

    def finish(self, timeout_s: float) -> None:
        """Coordinator, in ``finish`` (every rank's results gathered, so every rank checked in): the watch's
        outcome; CheckpointTimeoutError if its deadline passed first."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        if not watch.done.wait(timeout_s):
            raise CheckpointTimeoutError(f"{watch.phase}: the wait for the ranks' check-ins did not end")
        if isinstance(watch.error, CheckpointTimeoutError):
            raise watch.error
        if watch.error is not None:  # every rank's results are here: the store's trouble does not fail the save
            logger.warning("%s: the check-in keys could not be settled: %s", watch.phase, watch.error)


class _Watch:
    """The coordinator's wait for every check-in, on a daemon thread (see ``WrittenCheckIn.watch``)."""

    def __init__(self, check_in: WrittenCheckIn, phase: str, timeout_s: float) -> None:
        self.check_in = check_in
        self.phase = phase
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.ended = False
        threading.Thread(target=self._run, name="nxd_dcp_checkin", daemon=True).start()

    def end(self) -> None:
        """Stop waiting (a later save began, so this one is over: DCP's gather ended it with a failure): the
        all-arrived key set by hand wakes the thread, which deletes the save's keys."""
        if self.done.is_set():
            return
        self.ended = True
        try:
            self.check_in.store.set(all_arrived_key(self.check_in.prefix), b"1")
        except Exception as e:  # the store gone: the daemon thread ends with the process
            logger.debug("could not end the check-in wait of %s: %s", self.phase, e)

    def _run(self) -> None:
        c = self.check_in
        store = c.store
        try:
            wait_for_key(
                store,
                all_arrived_key(c.prefix),
                lambda limit: missing_ranks(store, c.prefix, c.world_size, limit),
                self.phase,
                self.timeout_s,
                log=False,
            )
            for first in range(0, c.world_size, ARRIVAL_GROUP):
                forget_step(store, c.prefix, first)
        except CheckpointTimeoutError as e:
            store.set(_verdict_key(c.prefix), str(e).encode())
            give_up(store, c.prefix, c.rank, e.missing_ranks)
            logger.error("%s", e)
            self.error = e
        except Exception as e:  # the store gone (the job ending): the save's own outcome comes from DCP's gather
            self.error = e
        finally:
            self.done.set()


def _verdict_key(prefix: str) -> str:
    """The coordinator's timeout error, for the ranks that arrive after it."""
    return f"{prefix}/verdict"


def check_recorded(
    per_rank: dict[int, dict[str, FileRecord]], world_size: int, needed: dict[str, int], path: str
) -> None:
    """Coordinator: every rank reported its file records, and each file ``.metadata`` points into is recorded as
    written up to the end it needs (``needed``: file -> end of its last item); CheckpointError naming the ranks
    without records or the first file short of its bytes (``path``: the folder as the caller named it)."""
    missing = [rank for rank in range(world_size) if rank not in per_rank]
    if missing:
        raise CheckpointError(
            f"{path}: rank(s) {ranks_text(missing)} reported no file records, so their files are not known to be "
            "durable; the save is not committed and the previous checkpoint stays; save again"
        )
    records: dict[str, FileRecord] = {}
    for recs in per_rank.values():
        records.update(recs)
    for rel, end in sorted(needed.items()):
        rec = records.get(rel)
        if rec is None or rec.size < end:
            state = "no rank recorded it" if rec is None else f"{rec.size} of {end} bytes"
            raise CheckpointError(
                f"{path}: {rel} is not recorded as written ({state}); the save is not committed and the "
                "previous checkpoint stays; save again"
            )
