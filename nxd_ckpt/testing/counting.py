"""Instrumented local storage for tests that prove how much of a checkpoint a load really reads."""

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
