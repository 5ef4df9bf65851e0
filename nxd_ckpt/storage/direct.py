"""Write streams for local files that send large files to the disk with O_DIRECT, bypassing the page cache.

Buffered writes followed by fsync ran 3-6x slower than ``dd oflag=direct`` on the VMs we benchmark on when the
CPUs are busy: every byte is copied into the page cache, then written back by kernel threads competing with
training for CPU, and dirty-page throttling stalls writers. ``DirectWriter`` copies into a reused, page-aligned
buffer (with NumPy, which releases the GIL) and writes each full chunk with O_DIRECT; a large write whose memory
address is congruent to the file position modulo the block size goes to the disk from its own memory instead
(``tensorfile`` pads tensor records so that this holds: no copy at all). The last partial chunk
of a file of at least ``DIRECT_MIN_BYTES`` is zero-padded to a block, written with O_DIRECT too, and the file
truncated to its length; smaller files go through the page cache. The caller fsyncs as usual. Filesystems
without O_DIRECT (tmpfs, some network filesystems) fall back to buffered writes silently. A full chunk goes to the
disk on a helper thread (``nxd_direct_write``, one write in flight per file) while the writer fills a second
buffer: the copy into the chunk and the caller's hashing of the next bytes overlap the disk's write, which a
synchronous O_DIRECT write (unlike a buffered one, whose writeback the kernel runs beside the writer) would
otherwise add to them. An error of that write is raised by the writer's next call.

Loads read the same way in reverse (``DirectReader``): a large ``readinto`` whose destination address is
congruent to the file position modulo the block size reads its block-aligned middle with O_DIRECT, straight
into the destination (a live parameter's memory: the disk writes there by DMA, no page-cache copy); the rest,
and every read that does not line up, is a plain ``pread`` through the page cache. Files saved by this library
line up with memory allocated the way the saving process allocated it (``tensorfile`` pads for it), which is
how a resumed model's parameters are allocated too.
``NXD_CKPT_DIRECT_IO=0`` turns both off.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from nxd_ckpt import knobs
from nxd_ckpt.storage.base import ForwardWriter, SeekableReader

CHUNK_BYTES = 16 << 20
BLOCK_BYTES = 4096
"""O_DIRECT alignment of lengths and offsets (a multiple of every common logical block size)."""
DIRECT_MIN_BYTES = 1 << 20
"""Files (and tails) at least this large go to the disk with O_DIRECT, the rest through the page cache."""
IN_PLACE_MIN_BYTES = 1 << 20
"""Writes at least this large whose memory lines up with the file position skip the chunk buffer."""
_GIL_FREE_COPY_BYTES = 256 << 10
_POOL_LIMIT = 16


def enabled() -> bool:
    return knobs.direct_io()


class _BufferPool:
    """Page-aligned chunk buffers kept for reuse: first-touch of fresh memory is slow in VMs."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, CHUNK_BYTES)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < _POOL_LIMIT:
                self._free.append(buf)
                return
        buf.close()


_pool = _BufferPool()

_WRITE_THREADS = 32
"""Helper threads writing full chunks (each file has at most one write in flight: more writers than threads wait)."""
_writes: ThreadPoolExecutor | None = None
_writes_lock = threading.Lock()


def _write_threads() -> ThreadPoolExecutor:
    """The process's chunk-writing threads, started on first use."""
    global _writes
    with _writes_lock:
        if _writes is None:
            _writes = ThreadPoolExecutor(max_workers=_WRITE_THREADS, thread_name_prefix="nxd_direct_write")
        return _writes


def _forget_write_threads() -> None:
    """In a forked child: the parent's threads do not exist there."""
    global _writes
    _writes = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_write_threads)


class _Chunk:
    """One page-aligned chunk buffer of the pool with its byte views."""

    def __init__(self) -> None:
        self.buf: mmap.mmap = _pool.get()
        self.view = memoryview(self.buf)
        self.array = np.frombuffer(self.buf, dtype=np.uint8)

    def release(self) -> None:
        del self.array  # releases its export of the buffer
        self.view.release()
        _pool.put(self.buf)


class DirectWriter(ForwardWriter):
    """A write-only binary stream onto ``fd``; ``finish`` writes the tail and fsyncs, ``close`` releases."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._chunk: _Chunk | None = _Chunk()
        self._view = self._chunk.view
        self._array = self._chunk.array
        self._spare: _Chunk | None = None
        """The buffer whose chunk is being written (``_in_flight``), filled next."""
        self._in_flight: Future | None = None
        self._pos = 0
        self._size = 0
        self._direct: bool | None = None  # unknown until the first full chunk

    def write(self, data: bytes | bytearray | memoryview) -> int:
        src = memoryview(data).cast("B")
        n = len(src)
        done = self._write_in_place(src) if n >= IN_PLACE_MIN_BYTES and self._direct is not False else 0
        self._buffer(src[done:])
        return n

    def _write_in_place(self, src: memoryview) -> int:
        """Send the block-aligned middle of ``src`` to the disk straight from its memory (no copy), when its
        address and the file position agree modulo the block size; returns the bytes of ``src`` consumed."""
        address = np.frombuffer(src, np.uint8).ctypes.data
        head = -address % BLOCK_BYTES
        middle = (len(src) - head) // BLOCK_BYTES * BLOCK_BYTES
        if (self._size + head) % BLOCK_BYTES or middle <= 0:
            return 0  # the writer did not line the data up with the file (see tensorfile.py)
        self._buffer(src[:head])
        if self._direct is None:
            self._direct = _set_direct(self._fd, True)
        if not self._direct:
            return head
        self._wait()  # in file order: the chunk in flight first
        if self._pos:  # whole blocks: everything before the aligned position
            _write_all(self._fd, self._view[: self._pos])
            self._pos = 0
        _write_all(self._fd, src[head : head + middle])
        self._size += middle
        return head + middle

    def _buffer(self, src: memoryview) -> None:
        """Copy ``src`` into the chunk buffer, writing each full chunk with O_DIRECT."""
        n = len(src)
        done = 0
        while done < n:
            take = min(CHUNK_BYTES - self._pos, n - done)
            if take >= _GIL_FREE_COPY_BYTES:  # NumPy copies without the GIL; a memoryview assignment holds it
                np.copyto(self._array[self._pos : self._pos + take], np.frombuffer(src[done : done + take], np.uint8))
            else:
                self._view[self._pos : self._pos + take] = src[done : done + take]
            self._pos += take
            done += take
            if self._pos == CHUNK_BYTES:
                self._flush_chunk()
        self._size += n

    def _flush_chunk(self) -> None:
        """Hand the full chunk to a helper thread (after the one before it is written) and go on in the spare."""
        if self._direct is None:
            self._direct = _set_direct(self._fd, True)
        self._wait()
        full, self._spare = self._chunk, self._spare or _Chunk()
        assert full is not None
        self._in_flight = _write_threads().submit(_write_chunk, self._fd, full, self._pos)
        self._chunk, self._spare = self._spare, full
        self._view, self._array = self._chunk.view, self._chunk.array
        self._pos = 0

    def _wait(self) -> None:
        """Until the chunk in flight is on the disk; its error is raised here."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def finish(self, fsync: bool = True) -> None:
        """Write what is buffered and fsync the file (unless the caller defers it).

        A tail of at least ``DIRECT_MIN_BYTES`` also bypasses the page cache: it is zero-padded to a whole
        block, written with O_DIRECT, and the file truncated back to its length. Smaller files and tails are
        written through the page cache (one small write and its flush cost less than the alignment dance).
        """
        self._wait()
        if self._pos:
            if self._direct is None and self._pos >= DIRECT_MIN_BYTES:
                self._direct = _set_direct(self._fd, True)
            if self._direct:
                padded = -(-self._pos // BLOCK_BYTES) * BLOCK_BYTES
                self._array[self._pos : padded] = 0
                _write_all(self._fd, self._view[:padded])
                if padded != self._pos:
                    os.ftruncate(self._fd, self._size)
            else:
                _write_all(self._fd, self._view[: self._pos])
            self._pos = 0
        if fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Release the buffers and the file (after a write still in flight: on an error path, its own error is
        left to the error being raised)."""
        if self._chunk is None:
            return
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            with contextlib.suppress(OSError):
                in_flight.result()
        del self._array, self._view
        for chunk in (self._chunk, self._spare):
            if chunk is not None:
                chunk.release()
        self._chunk = self._spare = None
        os.close(self._fd)

    def flush(self) -> None:
        """Nothing to do: data is written in chunks, and by ``finish``."""

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._chunk is None


def open_writer(path: str) -> DirectWriter:
    """A new file at ``path`` (created or truncated) behind a DirectWriter."""
    return DirectWriter(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666))


class DirectReader(SeekableReader):
    """A read-only binary stream of a local file whose large, lined-up ``readinto`` calls use O_DIRECT.

    Reads are positional (``pread``), never through a Python buffer. ``direct_bytes`` counts what went around
    the page cache (tests and benchmarks look at it).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._direct_fd: int | None = None
        self._direct_ok = bool(getattr(os, "O_DIRECT", 0)) and enabled()
        self._pos = 0
        self.direct_bytes = 0

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n >= IN_PLACE_MIN_BYTES and self._direct_ok:
            address = np.frombuffer(view, np.uint8).ctypes.data
            head = -address % BLOCK_BYTES
            middle = (n - head) // BLOCK_BYTES * BLOCK_BYTES
            if (self._pos + head) % BLOCK_BYTES == 0 and middle > 0:
                if head:  # up to the first block boundary through the page cache; the next call lines up
                    return self._pread(view[:head])
                got = self._pread_direct(view[:middle])
                if got is not None:
                    return got
        return self._pread(view)

    def _pread(self, view: memoryview) -> int:
        n = os.preadv(self._checked_fd(), [view], self._pos)
        self._pos += n
        return n

    def _pread_direct(self, view: memoryview) -> int | None:
        """O_DIRECT read of whole blocks into ``view``; None when the filesystem refuses O_DIRECT."""
        if self._direct_fd is None:
            try:
                self._direct_fd = os.open(self._path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self._direct_ok = False
                return None
        try:
            n = os.preadv(self._direct_fd, [view], self._pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct_ok = False
            return None
        self._pos += n
        self.direct_bytes += n
        return n

    def _checked_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"read of closed file {self._path}")
        return self._fd

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(0, self._size() - self._pos)
        buf = bytearray(n)
        got = self.readinto(buf)
        return bytes(buf[:got])

    def _size(self) -> int:
        return os.fstat(self._checked_fd()).st_size

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct_fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _set_direct(fd: int, on: bool) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
        return on
    except OSError:  # the filesystem does not support O_DIRECT
        return False


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        try:
            done += os.write(fd, view[done:])
        except OSError as e:
            if e.errno == errno.EINVAL and _is_direct(fd):  # O_DIRECT refused this write: finish buffered
                _set_direct(fd, False)
                continue
            raise


def _write_chunk(fd: int, chunk: _Chunk, length: int) -> None:
    """``_write_all`` of the first ``length`` bytes of ``chunk`` (on a helper thread); the view made for it is gone
    when this returns, so that the buffer can be given back (and closed) at once."""
    view = chunk.view[:length]
    try:
        _write_all(fd, view)
    finally:
        view.release()


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
