"""Commit protocol of one save, over the c10d store (no collectives, so it is safe from a writer thread).

Every rank calls ``arrive`` once its files are durable (or with the error that stopped it). Rank 0 waits until
all ranks arrived, writes ``done`` only if none failed, and publishes the outcome; ranks that must know it
(a synchronous save) wait for that outcome. Keys are namespaced per save and removed two saves later.
"""

from __future__ import annotations

import time
from typing import Any

from .dist import store_timeout
from .errors import CheckpointError, RemoteRankError

_PREFIX = "nxd_ckpt/commit"
_MAX_POLL_S = 0.01
"""Longest pause between two polls of the store: the commit learns of the last arrival within 10 ms."""


class CommitBarrier:
    """Store-based arrive/outcome barrier for save number ``seq`` (identical on all ranks)."""

    def __init__(self, store: Any | None, session: str, seq: int, rank: int, world_size: int) -> None:
        self.store = store
        self.session = session
        self.seq = seq
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"{_PREFIX}/{session}/{seq}"

    def arrive(self, error: str | None = None) -> None:
        """Tell rank 0 this rank is finished with the save (``error`` is None on success)."""
        if self.store is None:
            self._local_error = error
            return
        if error is not None:
            self.store.set(f"{self.prefix}/error/{self.rank}", error.encode())
            self.store.add(f"{self.prefix}/errors", 1)
        self.store.add(f"{self.prefix}/arrived", 1)

    def wait_all_arrived(self) -> dict[int, str]:
        """Rank 0: wait for every rank; return the errors reported, by rank."""
        if self.store is None:
            err = getattr(self, "_local_error", None)
            return {} if err is None else {0: err}
        deadline = time.monotonic() + store_timeout().total_seconds()
        delay = 0.002
        while self.store.add(f"{self.prefix}/arrived", 0) < self.world_size:
            if time.monotonic() > deadline:
                arrived = self.store.add(f"{self.prefix}/arrived", 0)
                raise CheckpointError(
                    f"only {arrived} of {self.world_size} ranks finished writing save #{self.seq} within "
                    f"{store_timeout()}; raise NXD_CKPT_COMMIT_TIMEOUT_S if storage is that slow"
                )
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        if self.store.add(f"{self.prefix}/errors", 0) == 0:
            return {}
        errors = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/error/{r}"
            if self.store.check([key]):
                errors[r] = self.store.get(key).decode(errors="replace")
        return errors

    def publish_outcome(self, error: str | None) -> None:
        """Rank 0: announce whether ``done`` was written."""
        if self.store is not None:
            self.store.set(f"{self.prefix}/outcome", b"ok" if error is None else b"fail:" + error.encode())
            self._cleanup(self.seq - 2)

    def wait_outcome(self) -> None:
        """Ranks other than 0: wait for the outcome (polling, so it is safe on a writer thread); raise if the
        save failed."""
        if self.store is None:
            return
        key = f"{self.prefix}/outcome"
        # Polled with check() rather than store.wait(): a blocking wait holds the store client's lock, which
        # would stall the training thread's own store use while this runs on the writer thread.
        deadline = time.monotonic() + store_timeout().total_seconds()
        delay = 0.002
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"rank 0 did not publish the outcome of save #{self.seq} within {store_timeout()}; "
                    "raise NXD_CKPT_COMMIT_TIMEOUT_S if storage is that slow"
                )
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        value = self.store.get(key)
        if value != b"ok":
            raise RemoteRankError(value.decode(errors="replace").removeprefix("fail:"))

    def _cleanup(self, seq: int) -> None:
        if seq < 0 or self.store is None:
            return
        prefix = f"{_PREFIX}/{self.session}/{seq}"
        keys = [f"{prefix}/arrived", f"{prefix}/errors", f"{prefix}/outcome"]
        keys += [f"{prefix}/error/{r}" for r in range(self.world_size)]
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:
                return
