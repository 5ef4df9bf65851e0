"""The commit barrier of one save, over the c10d store (no collectives, so it is safe from a writer thread).

Every rank calls ``arrive`` once its files are durable (or with the exception that stopped it). Rank 0 waits
until all ranks arrived, writes ``done`` only if none failed, and publishes the outcome; ranks that must know
it (a synchronous save) wait for that outcome. Both waits have the save's deadline (``NXD_CKPT_TIMEOUT_S`` or
``timeout=``, counted from this rank's arrival): while waiting, rank 0 logs which ranks have not arrived, and
past it the waiting rank raises CheckpointTimeoutError naming them. A failure travels as a ``RankFailure``, so
every rank raises the same exception type. Arrivals go through ``ranks.arrivals`` (``arrive``: one ``add`` per rank,
by arrival groups). Keys are namespaced per save and removed two saves later by their owners (a rank its
failure report, a group's first rank the group's keys, rank 0 the shared ones), so no rank's store operations
per save grow with the number of ranks, or with the wait (the waits are blocking ``wait_for_key`` calls).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.ranks.arrivals import all_arrived_key, arrive, forget_step, missing_ranks, wait_for_key
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.ranks.failures import RankFailure

_PREFIX = "nxd_ckpt/commit"


class CommitBarrier:
    """Store-based arrive/outcome barrier for save number ``seq`` (identical on all ranks) of ``tag``."""

    def __init__(
        self,
        store: Any | None,
        session: str,
        seq: int,
        rank: int,
        world_size: int,
        timeout_s: float | None = None,
        tag: str = "",
    ) -> None:
        self.store = store
        self.session = session
        self.seq = seq
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = resolve_timeout(timeout_s)
        self.tag = tag
        self.prefix = f"{_PREFIX}/{session}/{seq}"
        self._arrived_at: float | None = None
        self._local_failure: RankFailure | None = None

    @property
    def phase(self) -> str:
        return f"commit of {self.tag!r}" if self.tag else f"commit of save #{self.seq}"

    def arrive(self, error: BaseException | None = None) -> None:
        """Tell rank 0 this rank is finished with the save (``error`` is None on success)."""
        self._arrived_at = time.monotonic()
        failure = None if error is None else RankFailure.of(error, self.rank, f"writing {self.tag!r}")
        if self.store is None:
            self._local_failure = failure
            return
        if failure is not None:
            self.store.set(f"{self.prefix}/error/{self.rank}", pickle.dumps(failure))
            self.store.add(f"{self.prefix}/errors", 1)
        self._forget_own(self.seq - 2)  # before arriving: off the path of the ranks that wait
        arrive(self.store, self.prefix, self.rank, self.world_size)

    def wait_all_arrived(self) -> dict[int, RankFailure]:
        """Rank 0: wait for every rank (deadline, logs who is missing); return the failures reported, by rank."""
        if self.store is None:
            return {} if self._local_failure is None else {0: self._local_failure}
        store = self.store
        wait_for_key(
            store,
            all_arrived_key(self.prefix),
            lambda limit: missing_ranks(store, self.prefix, self.world_size, limit),
            f"{self.phase}: waiting for every rank's files",
            self.timeout_s,
            log=True,
            since=self._arrived_at,
        )
        if not store.check([f"{self.prefix}/errors"]):  # set by the first rank that reports a failure
            return {}
        failures = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/error/{r}"
            if store.check([key]):
                failures[r] = _load_failure(store.get(key), r, self.phase)
        return failures

    def publish_outcome(self, failure: RankFailure | None) -> None:
        """Rank 0: announce whether ``done`` was written (None) or why not."""
        if self.store is not None:
            self.store.set(f"{self.prefix}/outcome", b"ok" if failure is None else pickle.dumps(failure))
            self._cleanup(self.seq - 2)

    def wait_outcome(self) -> None:
        """Ranks other than 0: wait for the outcome (a blocking wait on this thread's own store connection, so it
        is safe on a writer thread); raise the failure (as its original type) if the save failed."""
        if self.store is None:
            return
        store = self.store
        key = f"{self.prefix}/outcome"

        def late(limit: int | None) -> list[int]:  # every rank arrived: rank 0 is the one stuck (writing 'done')
            return missing_ranks(store, self.prefix, self.world_size, limit) or [0]

        try:
            wait_for_key(
                store,
                key,
                late,
                f"{self.phase}: waiting for rank 0's outcome",
                self.timeout_s,
                log=self.rank == 1,  # rank 0 is the one awaited here: the next rank says so
                since=self._arrived_at,
            )
        except CheckpointTimeoutError as e:
            e.origin_rank = self.rank
            raise
        value = store.get(key)
        if value != b"ok":
            raise _load_failure(value, 0, self.phase).to_exception()

    def _cleanup(self, seq: int) -> None:
        """Rank 0: delete the shared keys of save ``seq`` (each rank deletes its own, see ``_forget_own``)."""
        if seq < 0 or self.store is None:
            return
        prefix = f"{_PREFIX}/{self.session}/{seq}"
        for key in (f"{prefix}/errors", f"{prefix}/outcome"):
            try:
                self.store.delete_key(key)
            except Exception:
                return

    def _forget_own(self, seq: int) -> None:
        """Delete the keys of save ``seq`` this rank owns (two saves back: every rank is done with it): its
        arrival group's or the shared ones (``forget_step``), and its failure report."""
        if seq < 0 or self.store is None:
            return
        prefix = f"{_PREFIX}/{self.session}/{seq}"
        forget_step(self.store, prefix, self.rank)
        try:
            self.store.delete_key(f"{prefix}/error/{self.rank}")
        except Exception:
            return


def _load_failure(data: bytes, rank: int, phase: str) -> RankFailure:
    """A RankFailure from the store (pickled by nxd_ckpt itself on another rank of this job)."""
    try:
        failure = pickle.loads(data)
        if isinstance(failure, RankFailure):
            return failure
    except Exception:
        pass
    return RankFailure(rank, phase, "nxd_ckpt.errors", "RemoteRankError", data.decode(errors="replace"))
