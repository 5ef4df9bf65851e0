"""Deadlines for this rank's own storage calls: a stall watchdog and a per-file deadline.

A storage call that never returns (a hung NFS/FUSE mount, a lost connection, a blocked device) cannot be
interrupted from Python. So the work that makes such calls runs on a helper thread (``run_watched``) while the
calling thread watches a ``StorageMonitor`` fed by ``WatchedStorage``: every file opened, every chunk of bytes
written and every call that returns is progress. No progress for the stall limit raises StorageStallError; a
file still being written after the deadline raises CheckpointTimeoutError; both name the file and how many
bytes moved. The abandoned helper thread may stay blocked in the kernel; the monitor is then cancelled, so it
starts no further storage call if that one ever returns.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, TypeVar

from nxd_ckpt.errors import CheckpointError, CheckpointTimeoutError, StorageStallError
from nxd_ckpt.ranks.deadlines import stall_limit_s
from nxd_ckpt.storage.base import CountingStream, DelegatingStorage, Storage

T = TypeVar("T")

_POLL_S = 0.05


class Cancelled(CheckpointError):
    """Raised in an abandoned helper thread when it tries to start another storage call."""


class _Op:
    __slots__ = ("moved", "path", "started", "what")

    def __init__(self, what: str, path: str) -> None:
        self.what, self.path, self.started, self.moved = what, path, time.monotonic(), 0


class StorageMonitor:
    """Progress of the storage calls of one phase (thread-safe): what runs, since when, how many bytes moved."""

    def __init__(self, phase: str, timeout_s: float, stall_s: float | None = None, url: str = "") -> None:
        self.phase = phase
        self.timeout_s = timeout_s
        self.stall_s = stall_limit_s(timeout_s) if stall_s is None else stall_s
        self.url = url
        self._lock = threading.Lock()
        self._ops: dict[int, _Op] = {}
        self._last_progress = time.monotonic()
        self._last_op: _Op | None = None
        self._off_storage = 0
        """Writers now waiting for something other than storage (``waiting_off_storage``)."""
        self.cancelled = False

    def reset(self, phase: str) -> None:
        """Start watching a new phase (the stall clock restarts)."""
        with self._lock:
            self.phase = phase
            self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def call(self, what: str, path: str) -> Iterator[_Op]:
        """Track one storage call on ``path`` for as long as the block runs."""
        if self.cancelled:
            raise Cancelled(f"not {what} {path}: this save was abandoned after a storage stall or deadline")
        op = _Op(what, path)
        with self._lock:
            self._ops[id(op)] = op
            self._last_progress = op.started
        try:
            yield op
        finally:
            with self._lock:
                del self._ops[id(op)]
                self._last_op = op
                self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def waiting_off_storage(self) -> Iterator[None]:
        """A writer waits for something other than storage (its device state's copy to reach the host, a wait with a
        deadline and an error of its own): meanwhile no stall is counted, and open files' clocks stop."""
        start = time.monotonic()
        with self._lock:
            self._off_storage += 1
        try:
            yield
        finally:
            waited = time.monotonic() - start
            with self._lock:
                self._off_storage -= 1
                self._last_progress = time.monotonic()
                for op in self._ops.values():
                    op.started += waited

    def moved(self, op: _Op, nbytes: int) -> None:
        with self._lock:
            op.moved += nbytes
            self._last_progress = time.monotonic()

    def check(self) -> None:
        """Raise if a storage call stalled or a file passed its deadline."""
        now = time.monotonic()
        with self._lock:
            if self._off_storage:
                return
            ops = sorted(self._ops.values(), key=lambda o: o.started)
            idle = now - self._last_progress
            last = self._last_op
        if idle > self.stall_s:
            op = ops[0] if ops else last
            where = f"{op.what} {self._name(op.path)} ({op.moved} bytes moved)" if op else "before any storage call"
            state = "still running" if ops else "last call"
            raise StorageStallError(
                f"{self.phase}: storage made no progress for {idle:.1f} s (stall limit {self.stall_s:g} s); "
                f"{state}: {where}. Check the filesystem or bucket (hung mount, lost connection, full device)",
                phase=self.phase,
                path=op.path if op else None,
                bytes_moved=op.moved if op else None,
            )
        overdue = [o for o in ops if now - o.started > self.timeout_s]
        if overdue:
            op = overdue[0]
            raise CheckpointTimeoutError(
                f"{self.phase}: {op.what} {self._name(op.path)} did not finish within {self.timeout_s:g} s "
                f"({op.moved} bytes moved); the storage is too slow or stuck. Raise NXD_CKPT_TIMEOUT_S or pass a "
                "larger timeout= if it is only slow",
                phase=self.phase,
                path=op.path,
                bytes_moved=op.moved,
            )

    def _name(self, path: str) -> str:
        return f"{self.url}/{path}" if self.url else path


class WatchedStorage(DelegatingStorage):
    """Reports every write-side storage call of a save to a StorageMonitor (reads pass through unwatched)."""

    def __init__(self, inner: Storage, monitor: StorageMonitor) -> None:
        super().__init__(inner)
        self.monitor = monitor
        if not monitor.url:
            monitor.url = inner.url

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self.monitor.call("writing", path) as op, self.inner.open_write(path) as f:
            report = functools.partial(self.monitor.moved, op)
            yield CountingStream(f, report)  # type: ignore[misc]

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        with self.monitor.call("writing", path) as op:
            self.inner.write_bytes(path, data)
            self.monitor.moved(op, len(memoryview(data).cast("B")))

    def delete(self, path: str) -> None:
        with self.monitor.call("deleting", path):
            self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        with self.monitor.call("deleting", path):
            self.inner.delete_tree(path)

    def sync_dirs(self, paths: Iterator[str] | list[str] | set[str]) -> None:
        paths = sorted(set(paths))
        with self.monitor.call("syncing the directories of", ", ".join(paths) or "."):
            self.inner.sync_dirs(paths)

    def write_from_local_file(self, path: str, local_file: str) -> None:
        with self.monitor.call("writing", path):
            self.inner.write_from_local_file(path, local_file)

    def durability_batch(self) -> AbstractContextManager[None]:
        """The backend's fsync batch, its final flush watched as one call."""
        return self._watched_batch(self.inner.durability_batch())

    @contextlib.contextmanager
    def _watched_batch(self, batch: AbstractContextManager[None]) -> Iterator[None]:
        batch.__enter__()
        try:
            yield
        except BaseException as e:
            if not batch.__exit__(type(e), e, e.__traceback__):
                raise
        else:
            with self.monitor.call("flushing", "this rank's files to stable storage"):
                batch.__exit__(None, None, None)


def run_watched(fn: Callable[[], T], monitor: StorageMonitor, name: str = "nxd_ckpt_io") -> T:
    """Run ``fn`` on a helper thread and return its result, raising its exception; raise StorageStallError or
    CheckpointTimeoutError (and abandon the thread) if ``monitor`` reports a stall or an overdue file first."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    while not done.wait(_POLL_S):
        try:
            monitor.check()
        except CheckpointTimeoutError:
            monitor.cancelled = True
            raise
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]
