"""Instrumentation for tests and the scale benchmark: local storage counting the bytes a load really reads, and a
c10d store client counting the operations a rank makes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.storage import direct as direct_io


class _CountingFile:
    """A read stream that counts the bytes it returns."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer) or 0
        self.count += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class ReadCountingStorage(LocalStorage):
    """Local storage counting the bytes read from each file, by any route (instrumentation, not a fake: it reads
    the disk). ``bytes_read`` maps each path read to its byte count."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.bytes_read: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.bytes_read[path] = self.bytes_read.get(path, 0) + n

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with super().open_read(path) as f:
            counting = _CountingFile(f)
            try:
                yield counting  # type: ignore[misc]
            finally:
                self._count(path, counting.count)

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False) -> Iterator[BinaryIO]:
        if not (direct and direct_io.enabled()):  # LocalStorage reads through open_read above: counted there
            with self.open_read(path) as f:
                yield f
            return
        with super().open_sequential(path, direct) as f:
            counting = _CountingFile(f)
            try:
                yield counting  # type: ignore[misc]
            finally:
                self._count(path, counting.count)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = super().read_bytes(path, offset, length)
        self._count(path, len(data))
        return data


class StoreTally:
    """Store operations counted by ``CountingStore`` clients (thread-safe): ``ops[(client, op)]``, where client is
    "main" for the client itself and "waiting" for the connections it cloned (the blocking waits)."""

    def __init__(self) -> None:
        self.ops: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def add(self, client: str, op: str) -> None:
        with self._lock:
            self.ops[(client, op)] = self.ops.get((client, op), 0) + 1

    def total(self, client: str | None = None) -> int:
        with self._lock:
            return sum(n for (c, _), n in self.ops.items() if client is None or c == client)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.ops)


class CountingStore:
    """A c10d store client that counts every operation made through it into ``tally`` and forwards it to the
    real store (instrumentation, not a fake: the operations reach the real server). ``clone()`` opens a real
    second connection whose operations count as "waiting"."""

    OPS = frozenset(
        ("set", "get", "add", "check", "wait", "delete_key", "compare_set", "multi_get", "multi_set", "append")
    )

    def __init__(self, store: Any, tally: StoreTally | None = None, client: str = "main") -> None:
        self._store = store
        self.tally = tally if tally is not None else StoreTally()
        self._client = client

    def clone(self) -> CountingStore:
        return CountingStore(self._store.clone(), self.tally, "waiting")

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if name not in self.OPS:
            return real

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.tally.add(self._client, name)
            return real(*args, **kwargs)

        return counted
