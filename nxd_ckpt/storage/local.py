"""Local (or shared POSIX, e.g. FSx for Lustre) filesystem storage: tmp file + fsync + rename per file."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from nxd_ckpt.errors import StorageError
from nxd_ckpt.storage import direct
from nxd_ckpt.storage import direct as direct_io
from nxd_ckpt.storage.base import Storage, check_relative_path

WRITE_BUFFER_BYTES = 8 << 20


class LocalStorage(Storage):
    """A checkpoint directory on a POSIX filesystem; nothing is ever written or deleted outside ``root``."""

    host_page_cache = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        _check_is_directory_path(self.root)
        self.url = self.root
        self._batch: list[str] | None = None
        self._batch_lock = threading.Lock()

    @contextlib.contextmanager
    def deferred_fsync(self, threads: int = 16) -> Iterator[None]:
        """Files written inside the block are fsynced together, in parallel, when it ends (not one by one).

        One fsync per file is a cache flush per file: with many files (xser writes one per tensor) it costs
        more than the data. Deferring is safe for checkpoint files because nothing trusts them before the
        ``done`` marker, written after the block. Files are renamed into place before they are durable.
        """
        with self._batch_lock:
            if self._batch is not None:  # already deferring: the outer block syncs
                nested = True
            else:
                nested, self._batch = False, []
        if nested:
            yield
            return
        try:
            yield
        except BaseException:
            with self._batch_lock:
                self._batch = None
            raise
        with self._batch_lock:
            paths, self._batch = self._batch or [], None
        if paths:
            with ThreadPoolExecutor(max_workers=min(threads, len(paths)), thread_name_prefix="nxd_fsync") as pool:
                list(pool.map(fsync_path, paths))

    def durability_batch(self) -> AbstractContextManager[None]:
        return self.deferred_fsync()

    def local_path(self, path: str) -> str | None:
        return self._abs(path)

    def _abs(self, path: str) -> str:
        check_relative_path(path)
        full = os.path.normpath(os.path.join(self.root, path)) if path else self.root
        if full != self.root and not full.startswith(self.root + os.sep):
            raise StorageError(f"path {path!r} resolves outside the checkpoint directory {self.root}")
        return full

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        final = self._abs(path)
        directory = os.path.dirname(final)
        tmp = temp_name(final)
        try:
            os.makedirs(directory, exist_ok=True)
            if direct.enabled():  # large files bypass the page cache (see direct.py)
                f: BinaryIO | direct.DirectWriter = direct.open_writer(tmp)
            else:
                f = open(tmp, "wb", buffering=WRITE_BUFFER_BYTES)  # noqa: SIM115 - closed below on every path
        except OSError as e:
            raise StorageError(f"cannot create {final}: {e.strerror or e}") from e
        try:
            yield f  # type: ignore[misc]
            deferred = self._batch is not None
            if isinstance(f, direct.DirectWriter):
                f.finish(fsync=not deferred)
            else:
                f.flush()
                if not deferred:
                    os.fsync(f.fileno())
            f.close()
            os.replace(tmp, final)
            if deferred:
                with self._batch_lock:
                    if self._batch is not None:
                        self._batch.append(final)
                        deferred = False
                if deferred:  # the block ended while this file was written: sync it now
                    fsync_path(final)
        except BaseException as e:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"writing {final} failed: {e.strerror or e}") from e
            raise

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        full = self._abs(path)
        try:
            f = open(full, "rb")  # noqa: SIM115
        except FileNotFoundError as e:
            raise StorageError(f"file not found: {full}") from e
        except OSError as e:
            raise StorageError(f"cannot read {full}: {e.strerror or e}") from e
        with f:
            yield f

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False) -> Iterator[BinaryIO]:
        if not direct or not direct_io.enabled():
            with self.open_read(path) as f:
                yield _ReadAhead(f)  # type: ignore[misc]
            return
        full = self._abs(path)
        try:
            reader = direct_io.DirectReader(full)
        except FileNotFoundError as e:
            raise StorageError(f"file not found: {full}") from e
        except OSError as e:
            raise StorageError(f"cannot read {full}: {e.strerror or e}") from e
        with reader:
            yield reader  # type: ignore[misc]

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open_read(path) as f:
            if offset:
                f.seek(offset)
            return f.read() if length is None else f.read(length)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def list_dir(self, path: str = "") -> list[str]:
        full = self._abs(path)
        try:
            return sorted(n for n in os.listdir(full) if ".tmp-" not in n)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk_files(self, path: str = "") -> list[str]:
        out = []
        base = self._abs(path)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if ".tmp-" in name:
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), self.root)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)

    def size(self, path: str) -> int:
        return os.path.getsize(self._abs(path))

    def mtime(self, path: str) -> float:
        return os.path.getmtime(self._abs(path))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(path))

    def delete_tree(self, path: str) -> None:
        full = self._abs(path)
        if full == self.root:
            raise StorageError(f"refusing to delete the whole checkpoint directory {self.root}")
        shutil.rmtree(full, ignore_errors=False) if os.path.isdir(full) else self.delete(path)

    renames_dirs = True

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename directory ``src`` to ``dst`` (which must not exist); durable once the parent
        directory is synced."""
        try:
            os.rename(self._abs(src), self._abs(dst))
        except OSError as e:
            raise StorageError(f"cannot rename {self._abs(src)} to {self._abs(dst)}: {e.strerror or e}") from e

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap directories ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False when this
        system or filesystem cannot, so the caller falls back to two renames."""
        try:
            rename_exchange(self._abs(a), self._abs(b))
        except OSError as e:
            if e.errno in _EXCHANGE_UNSUPPORTED:
                return False
            raise StorageError(f"cannot exchange {self._abs(a)} and {self._abs(b)}: {e.strerror or e}") from e
        return True

    def sync_dirs(self, paths: Iterator[str] | list[str] | set[str]) -> None:
        for path in sorted(set(paths)):
            full = self._abs(path)
            try:
                fd = os.open(full, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def rename_exchange(a: str, b: str) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)``: both paths exist before and after, with their contents swapped.
    Raises OSError (ENOSYS where libc or the kernel lacks it, EINVAL where the filesystem does)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library")
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def fsync_path(path: str) -> None:
    """Make the file or directory at ``path`` durable (fsync through a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: str) -> str:
    """A hidden name next to ``final`` for a file being written (``.<name>.tmp-<random>``; readers skip it)."""
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


def publish(tmp: str, final: str) -> None:
    """Make ``tmp`` durable (fsync) and rename it to ``final``; the directory entry is the caller's to sync."""
    fsync_path(tmp)
    os.replace(tmp, final)


@contextlib.contextmanager
def atomic_file(final: str) -> Iterator[str]:
    """A temporary path to write ``final`` through: on success it is fsynced and renamed into place, on an
    error removed, so ``final`` is never seen half-written (tools writing outside a Storage use this)."""
    os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
    tmp = temp_name(final)
    try:
        yield tmp
        publish(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _check_is_directory_path(root: str) -> None:
    """``root`` and its nearest existing ancestor must be directories: a checkpoint directory under a regular file
    (``notes.txt/ckpt``) would otherwise fail later with a raw NotADirectoryError naming some inner file."""
    existing = root
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            return
        existing = parent
    if not os.path.isdir(existing):
        if existing == root:
            raise StorageError(f"checkpoint directory {root} is a regular file, not a directory; choose a directory")
        raise StorageError(
            f"checkpoint directory {root} cannot exist: {existing} is a regular file, not a directory; "
            "choose another path"
        )


class _ReadAhead:
    """A local file read front to back through the page cache, with the kernel asked to read ``WINDOW`` bytes
    ahead of the reader (``POSIX_FADV_WILLNEED``, which only queues the reads): the disk keeps large requests in
    flight while the caller copies (and hashes) small pieces out of the cache. The default read-ahead (often
    128 KiB) leaves a cold disk idle between such pieces."""

    WINDOW = 128 << 20
    """Measured on this VM's disk (cold 800 MiB plain file, verified fresh-dict load): 32 MiB ahead took 0.60-1.3 s,
    128 MiB 0.51-0.68 s, torch.load 0.76-2.4 s in the same runs."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._fd = f.fileno()
        self._advised = 0

    def _ahead(self) -> None:
        pos = self._f.tell()
        if pos + self.WINDOW // 2 >= self._advised:
            start = max(pos, self._advised)
            with contextlib.suppress(OSError, AttributeError):  # advice only: systems without it read as before
                os.posix_fadvise(self._fd, start, pos + self.WINDOW - start, os.POSIX_FADV_WILLNEED)
            self._advised = pos + self.WINDOW

    def readinto(self, b: Any) -> int:
        self._ahead()
        return self._f.readinto(b)  # type: ignore[attr-defined]

    def read(self, n: int = -1) -> bytes:
        self._ahead()
        return self._f.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
