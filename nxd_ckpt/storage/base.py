"""The storage interface: bytes and "/"-separated relative paths only, no torch, no serialization.

What a backend can do beyond the abstract methods is said by explicit capabilities on ``Storage``
(``durability_batch``, ``local_path``, ``ranged_reads``, ``write_from_local_file``, ``host_page_cache``,
``whole_file_reads``), never found out with ``getattr``/``isinstance`` or by unwrapping. Wrappers derive from
``DelegatingStorage``, which forwards every one of them by name (no ``__getattr__``), so a capability added
here reaches the backend through every wrapper, or is consciously overridden by one
(``tests/unit/storage/test_capabilities.py`` checks both).

Paths are relative to the storage root (the checkpoint directory). Strings rather than ``Path`` objects, because
``s3://bucket/prefix`` must not be mangled. Retention, tag resolution and the commit protocol are built on this
surface without knowing which backend answers.
"""

from __future__ import annotations

import abc
import contextlib
import io
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

import numpy as np

from nxd_ckpt.errors import InvalidTagError

_PIECE_BYTES = 4 << 20
NOT_FOUND = "file not found"
"""How every backend's StorageError for a missing file begins (``is_not_found`` recognises it)."""


def is_not_found(error: BaseException) -> bool:
    """Whether ``error`` says a file is not there: FileNotFoundError, or a backend's StorageError for a missing
    file (also after it crossed ranks pickled, which keeps its message but not its cause)."""
    if isinstance(error, FileNotFoundError):
        return True
    return isinstance(error, OSError) and (
        isinstance(error.__cause__, FileNotFoundError) or str(error).startswith(NOT_FOUND)
    )


Allocator = Callable[[int], np.ndarray]
"""Returns an uninitialised, writable, contiguous uint8 array of the given size."""


def _empty(size: int) -> np.ndarray:
    return np.empty(size, dtype=np.uint8)


def check_relative_path(path: str) -> str:
    """Reject paths that could leave the storage root (absolute, ``..``, empty components)."""
    if not isinstance(path, str) or path.startswith("/") or "\\" in path:
        raise InvalidTagError(f"storage path {path!r} must be relative and use '/' separators")
    parts = path.split("/") if path else []
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidTagError(f"storage path {path!r} has an empty, '.' or '..' component")
    return path


class Storage(abc.ABC):
    """A checkpoint directory on some backend."""

    url: str
    whole_file_reads: bool = False
    """Whether loaders should read whole files with ``read_buffer`` (set by storages that check every file's
    bytes, e.g. VerifyingStorage: streaming would read each file twice there). Elsewhere loaders stream, which
    measured as fast or faster for unverified loads."""
    host_page_cache: bool = False
    """Whether reads go through this host's page cache (a local or POSIX filesystem), so replicas on one host
    can share a read: the first reader brings a file in from the device, the others copy it from memory."""
    ranged_reads: bool = False
    """Whether ``read_bytes(path, offset, length)`` fetches just that range while ``open_read`` fetches the whole
    file (S3): readers that need a few parts of a big file should then read ranges."""
    mtime_resolution_s: float = 0.0
    """How coarse ``mtime`` is: the true time lies in ``[mtime, mtime + resolution)`` (S3's LastModified is whole
    seconds), so ordering by it is only certain beyond that."""

    def durability_batch(self) -> AbstractContextManager[None]:
        """Files written inside the block are made durable together when it ends (one flush for many files,
        in parallel) instead of one by one; nothing to batch where each write is durable on its own (S3)."""
        return contextlib.nullcontext()

    def local_path(self, path: str) -> str | None:
        """Where ``path`` lives on this host's filesystem, when it may be read there directly (memory-mapped)
        instead of through ``open_read``; None on remote storage, and in wrappers that must see every byte."""
        return None

    def write_from_local_file(self, path: str, local_file: str) -> None:
        """Write ``path`` with the content of an existing local file (S3: one upload straight from the file)."""
        with open(local_file, "rb") as src, self.open_write(path) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    renames_dirs: bool = False
    """Whether ``rename_dir`` works (a POSIX filesystem); object stores have no directories to rename."""

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename directory ``src`` to ``dst`` (which must not exist), where ``renames_dirs``."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename directories ({self.url})")

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap directories ``a`` and ``b``; False where the storage or filesystem cannot."""
        return False

    @abc.abstractmethod
    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A writable binary stream; the file appears at ``path`` only when the block exits without error.

        On local disk the data is flushed and fsynced to a temporary name and renamed into place; on S3 the
        object is uploaded when the block ends. An exception inside the block leaves nothing at ``path``.
        """

    @abc.abstractmethod
    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A readable, seekable binary stream of the whole file."""

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """The file's bytes, or ``length`` bytes from ``offset``."""

    def open_sequential(self, path: str, direct: bool = False) -> AbstractContextManager[BinaryIO]:
        """A stream for reading the file once, front to back, with large ``readinto`` calls into the memory the
        data should end up in (loads into live tensors). ``direct``: the caller does not need the data in the
        page cache afterwards (no replica on this host reads the file after it), so local storage may read it
        with O_DIRECT. Wrappers that check what is read (VerifyingStorage) see every byte; the default is
        ``open_read``."""
        return self.open_read(path)

    def read_buffer(self, path: str, allocate: Allocator | None = None) -> np.ndarray:
        """The whole file in one writable uint8 array, read from storage once.

        Loads hash and parse this one buffer (tensors are views of it), so no byte is read twice. ``allocate(n)``
        returns an uninitialised uint8 array of ``n`` bytes (default ``np.empty``; zeroing would touch every page
        twice); loaders pass torch's allocator. The array is filled by ``readinto`` of ``open_read``'s stream, so
        wrappers of ``open_read`` see these reads; a buffered local file then reads straight into the array
        (reads larger than its buffer bypass it), one system call per 2 GiB.
        """
        with self.open_read(path) as f:
            return read_whole(f, allocate)

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file (or a non-empty directory/prefix) exists at ``path``."""

    @abc.abstractmethod
    def list_dir(self, path: str = "") -> list[str]:
        """Names directly under ``path`` (files and sub-directories), sorted; empty if there is nothing."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of a file in bytes."""

    @abc.abstractmethod
    def mtime(self, path: str) -> float:
        """Modification time of a file (seconds since the epoch)."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abc.abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete a directory/prefix and everything under it; missing is not an error."""

    def sync_dirs(self, paths: Iterator[str] | list[str] | set[str]) -> None:  # noqa: B027 - optional hook
        """Make renames into these directories durable (fsync on local disk; nothing to do on S3)."""

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole small file atomically."""
        with self.open_write(path) as f:
            f.write(data)

    def walk_files(self, path: str = "") -> list[str]:
        """All file paths under ``path`` (recursive), relative to the root, sorted."""
        out: list[str] = []
        for name in self.list_dir(path):
            child = f"{path}/{name}" if path else name
            sub = self.list_dir(child)
            if sub:
                out.extend(self.walk_files(child))
            elif self.exists(child):
                out.append(child)
        return sorted(out)


def read_whole(
    f: BinaryIO, allocate: Allocator | None = None, on_piece: Callable[[memoryview], None] | None = None
) -> np.ndarray:
    """The rest of the seekable stream ``f`` from its start, in one array from ``allocate``. With ``on_piece``,
    the stream is read in 4 MiB pieces, each handed to ``on_piece`` right after it is read (still in the CPU
    cache: verified reads hash it there); without, in one ``readinto``."""
    size = f.seek(0, 2)
    f.seek(0)
    buffer = (allocate or _empty)(size)
    view = memoryview(buffer)
    if on_piece is None:
        return buffer[: read_fully(f, view)]
    done = 0
    while done < size:
        n = read_fully(f, view[done : done + _PIECE_BYTES])
        if not n:
            break
        on_piece(view[done : done + n])
        done += n
    return buffer[:done]


def read_fully(f: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``f``; returns the bytes read (fewer only when the stream ends first)."""
    done = 0
    readinto = getattr(f, "readinto", None)
    while done < len(view):
        if readinto is not None:
            n = readinto(view[done:])
        else:
            data = f.read(len(view) - done)
            n = len(data)
            view[done : done + n] = data
        if not n:
            break
        done += n
    return done


class DelegatingStorage(Storage):
    """Forwards every method and capability of ``Storage`` to ``inner`` explicitly; wrappers (checksums,
    verification, progress) override what they change. Backend-specific attributes are not forwarded: ask a
    capability instead."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    @property  # type: ignore[override]
    def host_page_cache(self) -> bool:
        return self.inner.host_page_cache

    @property  # type: ignore[override]
    def ranged_reads(self) -> bool:
        return self.inner.ranged_reads

    @property  # type: ignore[override]
    def whole_file_reads(self) -> bool:
        return self.inner.whole_file_reads

    @property  # type: ignore[override]
    def mtime_resolution_s(self) -> float:
        return self.inner.mtime_resolution_s

    @property  # type: ignore[override]
    def renames_dirs(self) -> bool:
        return self.inner.renames_dirs

    def rename_dir(self, src: str, dst: str) -> None:
        self.inner.rename_dir(src, dst)

    def exchange_dirs(self, a: str, b: str) -> bool:
        return self.inner.exchange_dirs(a, b)

    def durability_batch(self) -> AbstractContextManager[None]:
        return self.inner.durability_batch()

    def local_path(self, path: str) -> str | None:
        return self.inner.local_path(path)

    def write_from_local_file(self, path: str, local_file: str) -> None:
        self.inner.write_from_local_file(path, local_file)

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write_bytes(path, data)

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_write(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_read(path)

    def open_sequential(self, path: str, direct: bool = False) -> AbstractContextManager[BinaryIO]:
        return self.inner.open_sequential(path, direct)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read_bytes(path, offset, length)

    def read_buffer(self, path: str, allocate: Allocator | None = None) -> np.ndarray:
        return self.inner.read_buffer(path, allocate)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(path)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def mtime(self, path: str) -> float:
        return self.inner.mtime(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)

    def sync_dirs(self, paths: Iterator[str] | list[str] | set[str]) -> None:
        self.inner.sync_dirs(paths)

    def walk_files(self, path: str = "") -> list[str]:
        return self.inner.walk_files(path)


PROGRESS_CHUNK_BYTES = 64 << 20
"""One ``write`` of a large tensor record is passed on in pieces of this size, each reported as progress, so a
multi-GB record on a slow disk is not mistaken for a stall (``watchdog``)."""


class CountingStream:
    """A stream that reports to ``report`` the bytes read or written through it (everything else goes to
    ``target``): the stall watchdog and the command's progress bars count with it. A write is passed on in pieces
    of at most ``chunk_bytes``, each reported."""

    def __init__(self, target: Any, report: Callable[[int], Any], chunk_bytes: int = PROGRESS_CHUNK_BYTES) -> None:
        self._target, self._report, self._chunk_bytes = target, report, chunk_bytes

    def read(self, n: int = -1) -> bytes:
        data = self._target.read(n)
        self._report(len(data))
        return data

    def readinto(self, buffer: Any) -> int | None:
        n = self._target.readinto(buffer)
        self._report(n or 0)
        return n

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view) or not view:
            piece = view[done : done + self._chunk_bytes]
            n = self._target.write(piece)
            n = len(piece) if n is None else n
            self._report(n)
            done += n
            if n < len(piece) or not view:  # a short write: report it as the stream did
                break
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class ForwardWriter:
    """What every write-only stream of ours says of itself: writable, not readable, not seekable (torch.save
    and tarfile then write forward only)."""

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False


class SeekableReader:
    """What every read-only, seekable stream of ours says of itself, and how it seeks: from the start, its position
    ``_pos`` (which its reads move) or its end (``_size()``, the subclass's)."""

    _pos: int

    def _size(self) -> int:
        """The stream's length in bytes, where ``SEEK_END`` counts from."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size()}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos
