"""Instrumentation for tests and the scale benchmark: local storage counting the bytes a load really reads, a
c10d store client counting the operations a rank makes (``ThreadWorld(count=True)``), and storage counting the S3
requests each call would make."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from nxd_ckpt.storage import LocalStorage, Storage
from nxd_ckpt.storage import direct as direct_io
from nxd_ckpt.storage.base import DelegatingStorage


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


class _CountingWriter:
    """A write stream that counts the bytes written through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.count = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self.count += len(memoryview(data).cast("B"))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _prefix_of(path: str, depth: int = 2) -> str:
    """The key prefix S3 would partition on at ``depth`` levels (``step_1/model`` for model files)."""
    parts = path.split("/")[:-1]
    return "/".join(parts[:depth]) or "."


class RequestCountingStorage(DelegatingStorage):
    """Any storage, counting the S3 requests its calls would make: PUT (multipart past ``part_size``: one create,
    one per part, one complete), GET, HEAD, LIST (1,000 keys per page), DELETE; by kind and by key prefix. The
    calls are forwarded to ``inner`` (instrumentation, not a fake). Renames are counted as RENAME (S3 has none)."""

    def __init__(self, inner: Storage, part_size: int = 16 << 20) -> None:
        super().__init__(inner)
        self.part_size = part_size
        self.requests: dict[str, int] = {}
        self.by_prefix: dict[str, dict[str, int]] = {}
        self.files_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def _add(self, kind: str, path: str, n: int = 1) -> None:
        with self._lock:
            self.requests[kind] = self.requests.get(kind, 0) + n
            counts = self.by_prefix.setdefault(_prefix_of(path), {})
            counts[kind] = counts.get(kind, 0) + n

    def _put(self, path: str, size: int) -> None:
        with self._lock:
            self.files_written += 1
            self.bytes_written += size
        if size <= self.part_size:
            self._add("PUT", path)
        else:
            self._add("POST", path, 2)  # create + complete multipart upload
            self._add("PUT", path, -(-size // self.part_size))

    def reset(self) -> None:
        with self._lock:
            self.requests, self.by_prefix, self.files_written, self.bytes_written = {}, {}, 0, 0

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        super().write_bytes(path, data)
        self._put(path, len(memoryview(data).cast("B")))

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            counting = _CountingWriter(f)
            yield counting  # type: ignore[misc]
        self._put(path, counting.count)

    def write_from_local_file(self, path: str, local_file: str) -> None:
        super().write_from_local_file(path, local_file)
        self._put(path, os.path.getsize(local_file))

    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        self._add("GET", path)
        return super().open_read(path)

    def open_sequential(self, path: str, direct: bool = False) -> contextlib.AbstractContextManager[BinaryIO]:
        self._add("GET", path)
        return super().open_sequential(path, direct)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self._add("GET", path)
        return super().read_bytes(path, offset, length)

    def read_buffer(self, path: str, allocate: Any = None) -> Any:
        self._add("GET", path)
        return super().read_buffer(path, allocate)

    def exists(self, path: str) -> bool:
        self._add("HEAD", path)
        return super().exists(path)

    def size(self, path: str) -> int:
        self._add("HEAD", path)
        return super().size(path)

    def mtime(self, path: str) -> float:
        self._add("HEAD", path)
        return super().mtime(path)

    def list_dir(self, path: str = "") -> list[str]:
        names = super().list_dir(path)
        self._add("LIST", f"{path}/x" if path else "x", max(1, -(-len(names) // 1000)))
        return names

    def walk_files(self, path: str = "") -> list[str]:
        names = super().walk_files(path)
        self._add("LIST", f"{path}/x" if path else "x", max(1, -(-len(names) // 1000)))
        return names

    def delete(self, path: str) -> None:
        self._add("DELETE", path)
        super().delete(path)

    def delete_tree(self, path: str) -> None:
        n = len(super().walk_files(path))
        self._add("LIST", f"{path}/x", max(1, -(-n // 1000)))
        self._add("POST", f"{path}/x", max(1, -(-n // 1000)))  # DeleteObjects, 1,000 keys per request
        super().delete_tree(path)

    def rename_dir(self, src: str, dst: str) -> None:
        self._add("RENAME", f"{src}/x")
        super().rename_dir(src, dst)
