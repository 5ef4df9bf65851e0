"""Checksums of every file a save writes, kept in per-rank manifests, and checked again on every read.

Saving: ``ChecksummingStorage`` wraps the save's storage; its ``open_write`` hashes the bytes (xxh3_64) as they
stream through, so every writer (plain, xser tensor files, per-rank state, metadata) is covered without knowing
about it. Before arriving at the commit barrier each rank makes its files' directories durable and writes
``<tag>/nxd_ckpt/manifest_rank_XXXXX.json`` (a folder NxD ignores): ``{path within the tag: [size, digest]}``
plus a checksum of the manifest itself. ``done`` comes after every manifest, so a complete tag has all of them.

Saving also records each file's block digests (``manifests.BlockHasher``: a block every 256 KiB and at each item a
writer marks with ``cut_block``), beside the whole file's.

Loading: ``VerifyingStorage`` wraps the load's storage for one tag; ``read_buffer`` of a listed file hashes the
whole-file buffer the loader then parses (each byte read once), ``open_read`` hashes the stream to the end and
seeks back; both compare size and digest with the manifest and raise IntegrityError naming the file on a mismatch.
``VerifiedFile`` reads byte ranges (re-sharded loads, the DCP reader): each range by the blocks holding it, every
block checked before any of its bytes is handed out (a file of an older manifest, without block digests: the whole
file once, first).
A load hands each rank only the records of the files it reads (``IndexShare``), not every rank's manifests.
Tags without manifests (written by NxD, or by nxd_ckpt before manifests existed) are read unverified.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from nxd_ckpt import pages
from nxd_ckpt.errors import FormatError, IntegrityError, StorageError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.manifests import (
    ALGORITHM,
    BLOCK_BYTES,
    MANIFEST_FORMAT,
    MANIFEST_PREFIX,
    MANIFEST_VERSION,
    RESTORE_HINT,
    BlockHasher,
    FileRecord,
    IndexShare,
    block_error,
    check_record,
    hash_stream,
    manifest_bytes,
    manifest_paths,
    new_hasher,
    parse_manifest,
    read_index,
    read_manifests,
    record_bytes,
    record_stream,
    split_index,
)
from nxd_ckpt.storage import DelegatingStorage, Storage
from nxd_ckpt.storage.base import NOT_FOUND, Allocator, ForwardWriter, read_fully, read_whole
from nxd_ckpt.storage.direct import DirectReader
from nxd_ckpt.storage.range_reads import open_for_partial_reads

logger = logging.getLogger("nxd_ckpt")

# The manifest format (records, sealing, parsing, the one reader) lives in format/manifests.py; these names are
# re-exported for callers of this module.
__all__ = [
    "ALGORITHM",
    "MANIFEST_FORMAT",
    "MANIFEST_PREFIX",
    "MANIFEST_VERSION",
    "ChecksummingStorage",
    "FileRecord",
    "IndexShare",
    "VerifiedFile",
    "VerifiedStream",
    "VerifyingStorage",
    "check_record",
    "hash_stream",
    "manifest_bytes",
    "manifest_paths",
    "new_hasher",
    "parse_manifest",
    "read_index",
    "read_manifests",
    "remove_manifests",
    "split_index",
]


def remove_manifests(storage: Storage, tag: str) -> None:
    """Delete a tag's manifests (before re-saving over it, so stale ones from another world size vanish)."""
    for path in manifest_paths(storage, tag):
        storage.delete(path)


def _ancestors(path: str, stop: str) -> set[str]:
    """Directories from ``path``'s parent up to and including ``stop``."""
    out: set[str] = set()
    parent = path.rsplit("/", 1)[0]
    while parent.startswith(stop + "/") or parent == stop:
        out.add(parent)
        if parent == stop:
            break
        parent = parent.rsplit("/", 1)[0]
    return out


# --------------------------------------------------------------------------------------------------- storages
class _HashingWriter(ForwardWriter):
    """A write-only stream that hashes and counts what passes through to ``target``.

    It has no ``seek`` or ``fileno``: a writer that rewrote earlier bytes or bypassed ``write`` would make the
    recorded checksum wrong, so such writers fail here instead of producing a false alarm on load.
    """

    def __init__(self, target: BinaryIO) -> None:
        self._target = target
        self._hasher = BlockHasher()
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            n = self._target.write(view)
        except OSError as e:  # kept: torch.save turns it into an opaque RuntimeError
            self.error = e
            raise
        written = len(view) if n is None else n
        self._hasher.update(view[:written])
        return written

    def cut_block(self) -> None:
        """An item starts here: its bytes get blocks of their own (``BlockHasher.cut``)."""
        self._hasher.cut()

    @property
    def size(self) -> int:
        return self._hasher.size

    def record(self, rank: int) -> FileRecord:
        return self._hasher.record(rank)

    def flush(self) -> None:
        self._target.flush()

    def tell(self) -> int:
        return self.size

    @property
    def closed(self) -> bool:
        return bool(getattr(self._target, "closed", False))

    def digest(self) -> str:
        return self._hasher.hexdigest()


class _HashingReader:
    """A read stream that hashes what passes through, in order. Bytes copied by the CPU (page cache, memory
    tier, sockets) are read ``piece`` bytes at a time and each piece is hashed right after its copy, while it is
    still in the CPU cache: one pass over memory instead of a copy and a second, hashing pass. ``piece=None``
    (O_DIRECT streams: the disk writes by DMA, and large requests keep it fast) reads as asked, then hashes."""

    PIECE = 1 << 20
    """Fits the per-core L2 cache of current x86 and Graviton server parts."""

    def __init__(self, source: BinaryIO, piece: int | None = PIECE) -> None:
        self._source = source
        self._piece = piece
        self._hasher = new_hasher()
        self.size = 0

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._piece is None:
            n = self._source.readinto(view) or 0  # type: ignore[attr-defined]
            for start in range(0, n, self.PIECE):
                self._hasher.update(view[start : min(n, start + self.PIECE)])
            self.size += n
            return n
        done = 0
        while done < len(view):  # stops at a short read (end of file, or what a socket had): callers loop
            want = min(self._piece, len(view) - done)
            n = self._source.readinto(view[done : done + want]) or 0  # type: ignore[attr-defined]
            self._hasher.update(view[done : done + n])
            done += n
            if n < want:
                break
        self.size += done
        return done

    def read(self, n: int = -1) -> bytes:
        data = self._source.read(n)
        self._hasher.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        """Read (and hash) whatever the caller left unread; usually nothing, so start with a small buffer."""
        buf = bytearray(64 << 10)
        while self.readinto(buf):
            if len(buf) < self.PIECE:
                buf = bytearray(self.PIECE)

    def digest(self) -> str:
        return self._hasher.hexdigest()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


class ChecksummingStorage(DelegatingStorage):
    """The storage of one save on one rank: records size and digest of every file written under ``tag``."""

    def __init__(self, inner: Storage, tag: str, rank: int) -> None:
        super().__init__(inner)
        self.tag = layout.validate_tag(tag)
        self.rank = rank
        self._records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_write(path) as f:
            writer = _HashingWriter(f)
            try:
                yield writer  # type: ignore[misc]
            except Exception as e:
                cause = writer.error
                if cause is None or isinstance(e, OSError):
                    raise
                # e.g. "[enforce fail at inline_container.cc] unexpected pos": name the file and the real cause
                raise StorageError(f"writing {self.url}/{path} failed: {cause.strerror or cause}") from cause
        self._record(path, writer.record(self.rank))

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Small files keep the backend's own one-shot path (one PUT on S3)."""
        self.inner.write_bytes(path, data)
        self._record(path, record_bytes(data, self.rank))

    def write_from_local_file(self, path: str, local_file: str, known: FileRecord | None = None) -> None:
        """Copy a local file; ``known`` is its record when this rank already hashed it while writing it (a memory
        tier copy going to durable storage): not hashed a second time, and a copy damaged in between fails
        verification on load instead of being recorded as it is."""
        if known is None:
            with open(local_file, "rb") as f:
                known = record_stream(f, self.rank)
        self.inner.write_from_local_file(path, local_file)
        self._record(path, dataclasses.replace(known, rank=self.rank))

    def _record(self, path: str, rec: FileRecord) -> None:
        if path.startswith(self.tag + "/"):
            with self._lock:
                self._records[path[len(self.tag) + 1 :]] = rec

    def delete(self, path: str) -> None:
        self.inner.delete(path)
        with self._lock:
            self._records.pop(path.removeprefix(self.tag + "/"), None)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)
        prefix = path.removeprefix(self.tag).strip("/")
        with self._lock:
            for rel in [r for r in self._records if not prefix or r == prefix or r.startswith(prefix + "/")]:
                del self._records[rel]

    @property
    def records(self) -> dict[str, FileRecord]:
        with self._lock:
            return dict(self._records)

    def write_manifest(self) -> str:
        """Make this rank's files durable (their directories fsynced) and write its manifest; return its path."""
        records = self.records
        path = layout.manifest_file(self.tag, self.rank)
        dirs: set[str] = {self.tag}
        for rel in records:
            dirs |= _ancestors(f"{self.tag}/{rel}", self.tag)
        self.inner.sync_dirs(dirs)
        self.inner.write_bytes(path, manifest_bytes(self.tag, self.rank, records))
        self.inner.sync_dirs([path.rsplit("/", 1)[0], self.tag])
        return path


class VerifyingStorage(DelegatingStorage):
    """Read access to one tag that checks every file listed in the tag's manifests against its record.

    ``index`` is the merged manifests (``read_index``), or this rank's share of them (``IndexShare``: what a
    load hands each rank), or None: then the whole index is read lazily on first use. A file outside the share
    is never read unchecked: the whole index is read then (every manifest, once; logged as a WARNING, and
    counted in ``index_fallbacks``, since it means the load's read plan missed a file).
    """

    whole_file_reads = True  # loaders call read_buffer: each file is read once, hashed and parsed in memory

    def __init__(self, inner: Storage, tag: str, index: dict[str, FileRecord] | IndexShare | None = None) -> None:
        super().__init__(inner)
        self.tag = layout.validate_tag(tag)
        share = IndexShare(index) if isinstance(index, dict) else index
        self._share = share
        self._index = share.records if share is not None and share.files is None else None
        self._lock = threading.Lock()
        self.files_verified = 0
        self.bytes_verified = 0
        self._verified: dict[str, VerifiedFile] = {}
        self.index_fallbacks: list[str] = []
        """Paths outside the share this storage was given, for which it read the whole index."""

    def index(self) -> dict[str, FileRecord]:
        """The whole merged index (read from the manifests here, once, unless it was given)."""
        with self._lock:
            if self._index is None:
                self._index = read_index(self.inner, self.tag)
            return self._index

    def record_for(self, path: str) -> FileRecord | None:
        if not path.startswith(self.tag + "/"):
            return None
        rel = path[len(self.tag) + 1 :]
        share = self._share
        if share is not None and share.covers(rel):
            return share.records.get(rel)
        if share is not None and share.files is not None:
            self._outside_share(path)
        return self.index().get(rel)

    def _outside_share(self, path: str) -> None:
        with self._lock:
            first = not self.index_fallbacks
            self.index_fallbacks.append(path)
        if first:
            logger.warning(
                "%s/%s is outside this rank's share of the manifests; reading every manifest of %s to check it "
                "(the load's read plan missed this file: please report it)", self.url, path, self.tag,
            )  # fmt: skip

    def local_path(self, path: str) -> str | None:
        """None for files this storage checks: reading them directly would skip the check."""
        return None if self.record_for(path) is not None else self.inner.local_path(path)

    def _check(self, path: str, rec: FileRecord, size: int, digest: str) -> None:
        check_record(self.url, self.tag, path, rec, size, digest)
        with self._lock:
            self.files_verified += 1
            self.bytes_verified += size

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        rec = self.record_for(path)
        with self.inner.open_read(path) as f:
            if rec is not None:
                size, digest = hash_stream(f)
                self._check(path, rec, size, digest)
                f.seek(0)
            yield f

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False) -> Iterator[BinaryIO]:
        """The file in one pass, hashed piece by piece as the caller reads it (into live tensors, say), and
        checked when the block ends: whatever the caller did not read is read and hashed then. Raises
        IntegrityError after the bytes have landed: callers that read into live memory say so."""
        rec = self.record_for(path)
        with self.inner.open_sequential(path, direct) as f:
            if rec is None:
                yield f
                return
            reader = _HashingReader(f, None if isinstance(f, DirectReader) else _HashingReader.PIECE)
            yield reader  # type: ignore[misc]
            reader.drain()
        self._check(path, rec, reader.size, reader.digest())

    def read_buffer(self, path: str, allocate: Allocator | None = None) -> np.ndarray:
        """The whole file, read once and checked in memory: loads parse this same buffer (single pass).

        Each piece is hashed right after it is read, while it is still in the CPU cache, instead of in a second
        pass over the whole buffer: the hash (which holds the GIL) is spread between the reads of all threads.
        """
        rec = self.record_for(path)
        if rec is None:
            return self.inner.read_buffer(path, allocate)
        hasher = new_hasher()
        with self.inner.open_read(path) as f:
            buffer = read_whole(f, allocate, on_piece=hasher.update)
        self._check(path, rec, buffer.nbytes, hasher.hexdigest())
        return buffer

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        rec = self.record_for(path)
        if rec is None or offset or length is not None:
            return self.inner.read_bytes(path, offset, length)
        data = self.inner.read_bytes(path)
        self._check(path, rec, *hash_bytes(data))
        return data

    def verified_file(self, path: str) -> VerifiedFile:
        """``path`` for reads of byte ranges, each checked before it is returned (``VerifiedFile``; one per path,
        so a file of an older manifest is hashed whole once, however many parts of it are read)."""
        with self._lock:
            found = self._verified.get(path)
        if found is None:
            found = VerifiedFile(self.inner, path, self.record_for(path), tag=self.tag)
            with self._lock:
                found = self._verified.setdefault(path, found)
        return found


def _will_need(f: Any, start: int, length: int) -> None:
    """Ask the kernel to read ``length`` bytes at ``start`` ahead (a local file read cold: the disk works on the
    whole range while the first blocks are checked); nothing where the stream is no local file."""
    advise = getattr(os, "posix_fadvise", None)
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return
    if advise is not None and length > BLOCK_BYTES:
        with contextlib.suppress(OSError):
            advise(fd, start, length, os.POSIX_FADV_WILLNEED)


_RUN_BYTES = 16 << 20
"""Bytes of whole blocks read in one request from ranged storage (S3) before they are checked."""


class VerifiedFile:
    """One file read by byte ranges (``read_into``), every byte checked against the file's record before it is
    handed out, so a caller may copy it straight into live memory.

    With block digests (``FileRecord.blocks``) only the blocks holding the range are read and each is hashed
    right after its read; a block shared with the next range is kept (a few, verified). With an older record
    (whole-file digest only) the first read hashes the whole file and checks it, then ranges are read as asked.
    Without a record (a file written without manifests) ranges are read unchecked; only a short file is found.
    Safe to use from several threads (each read opens its own stream: the file on local disk, ranged GETs on S3).
    """

    def __init__(
        self, storage: Storage, path: str, record: FileRecord | None, *, tag: str, kept_blocks: int = 4
    ) -> None:
        self.storage, self.path, self.record, self.tag = storage, path, record, tag
        self.kept_blocks = kept_blocks
        """How many blocks read in part are kept for the next range (each at most ``BLOCK_BYTES``)."""
        self.where = f"{storage.url}/{path}"
        self._lock = threading.Lock()
        self._whole_checked = False
        self._kept: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.bytes_read = 0
        """Bytes read from storage so far (blocks, and the whole file once for an older record)."""
        self.bytes_reused = 0
        """Bytes checked before and checked again as they are used from the page cache (``MappedSpan`` where a
        lock was refused): read from the disk again only where the kernel dropped them meanwhile."""

    def read(self, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)``, checked."""
        out = np.empty(end - start, dtype=np.uint8)
        self.read_into(start, memoryview(out))
        return out

    def read_into(self, start: int, view: memoryview) -> None:
        """Fill ``view`` with bytes ``[start, start + len(view))``, checked (IntegrityError naming the file on a
        mismatch or a short file; FormatError for a short file without a record)."""
        end = start + len(view)
        rec = self.record
        if end <= start:
            return
        self._check_end(end)
        with contextlib.ExitStack() as stack:
            opened: list[BinaryIO] = []

            def stream() -> BinaryIO:
                if not opened:
                    opened.append(stack.enter_context(open_for_partial_reads(self.storage, self.path)))
                    _will_need(opened[0], start, end - start)
                return opened[0]

            if rec is None or not rec.has_blocks:
                if rec is not None:
                    self._check_whole(rec)
                self._read_raw(stream(), start, view, None)
                return
            whole: list[tuple[int, int, str]] = []  # consecutive blocks the range covers entirely
            for block_start, block_end, digest in rec.blocks_over(start, end):
                lo, hi = max(block_start, start), min(block_end, end)
                if lo == block_start and hi == block_end:
                    whole.append((block_start, block_end, digest))
                    if not self.storage.ranged_reads or whole[-1][1] - whole[0][0] >= _RUN_BYTES:
                        self._read_blocks(stream, whole, view, start)
                    continue
                self._read_blocks(stream, whole, view, start)
                block = self._kept_block(stream, block_start, block_end, digest)
                view[lo - start : hi - start] = memoryview(block)[lo - block_start : hi - block_start]
            self._read_blocks(stream, whole, view, start)

    def checked_pieces(self, start: int, end: int, scratch: memoryview) -> Iterator[tuple[int, memoryview]]:
        """Bytes ``[start, end)`` as consecutive checked pieces ``(offset, bytes)``, each read into ``scratch``
        (at least ``BLOCK_BYTES``, reused: use a piece before asking for the next): a range of any length checked
        in the memory of one scratch buffer, which stays in the CPU cache. Blocks the range covers in part are
        read whole and checked."""
        if end <= start:
            return
        rec = self.record
        self._check_end(end)
        with open_for_partial_reads(self.storage, self.path) as f:
            _will_need(f, start, end - start)
            if rec is None or not rec.has_blocks:
                if rec is not None:
                    self._check_whole(rec)
                for at in range(start, end, len(scratch)):
                    piece = scratch[: min(len(scratch), end - at)]
                    self._read_raw(f, at, piece, None)
                    yield at, piece
                return
            if len(scratch) < BLOCK_BYTES:
                raise ValueError(f"checked_pieces needs a scratch of at least {BLOCK_BYTES} bytes, got {len(scratch)}")
            run: list[tuple[int, int, str]] = []
            for block in rec.blocks_over(start, end):
                if run and block[1] - run[0][0] > len(scratch):
                    yield self._checked_run(f, run, scratch, start, end)
                    run = []
                run.append(block)
            if run:
                yield self._checked_run(f, run, scratch, start, end)

    def mappable(self) -> bool:
        """Whether ``map_span`` can map this file: a local file recorded with block digests."""
        rec = self.record
        return rec is not None and bool(rec.blocks) and self.storage.local_path(self.path) is not None

    def prefetch(self, start: int, end: int) -> None:
        """Ask the kernel to read ``[start, end)`` of a local file ahead, all of it at once (the disk works on the
        whole load while the first blocks are checked); nothing elsewhere."""
        local = self.storage.local_path(self.path)
        advise = getattr(os, "posix_fadvise", None)
        if local is None or advise is None or end <= start:
            return
        with contextlib.suppress(OSError):
            fd = os.open(local, os.O_RDONLY)
            try:
                advise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def map_span(self, start: int, end: int) -> MappedSpan | None:
        """A read-only mapping of the blocks holding ``[start, end)``, checked piece by piece and kept (see
        ``MappedSpan``); None where the file is not ``mappable``."""
        if end <= start or not self.mappable():
            return None
        data, base = self._map(start, end)
        return MappedSpan(self, data, base)

    def _map(self, start: int, end: int) -> tuple[np.ndarray, int]:
        """A read-only mapping of the blocks holding ``[start, end)`` and the file offset it starts at (no page
        is read yet: ``MappedSpan.check`` faults them in as it locks them)."""
        rec, local = self.record, self.storage.local_path(self.path)
        if rec is None or not rec.blocks or local is None:
            raise ValueError(f"{self.where} cannot be mapped (not a local file with block digests)")
        self._check_end(end)
        first, last = rec.blocks_over(start, end)[0][0], rec.blocks_over(max(start, end - 1), end)[-1][1]
        base = first // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        try:
            fd = os.open(local, os.O_RDONLY)
        except FileNotFoundError as e:  # worded as every backend words it (``is_not_found``)
            raise StorageError(f"{NOT_FOUND}: {local}") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.where}: {e.strerror or e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < last:
                raise block_error(self.storage.url, self.tag, self.path, rec, start, last, size - start)
            mapping = mmap.mmap(fd, last - base, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
        finally:
            os.close(fd)  # the mapping stays
        return np.frombuffer(mapping, dtype=np.uint8), base

    def _count(self, nbytes: int, again: bool) -> None:
        """Bytes taken from storage (``bytes_read``), or with ``again`` checked again (``bytes_reused``)."""
        with self._lock:
            if again:
                self.bytes_reused += nbytes
            else:
                self.bytes_read += nbytes

    def _checked_blocks(self, data: np.ndarray, base: int, start: int, end: int) -> Iterator[tuple[int, np.ndarray]]:
        """Each block of ``data`` (mapped from ``base``) holding ``[start, end)`` checked, and its part inside."""
        rec = self.record
        assert rec is not None
        for block_start, block_end, digest in rec.blocks_over(start, end):
            block = data[block_start - base : block_end - base]
            found = hash_bytes(block)[1]
            if found != digest:
                del block, data  # the error's traceback keeps this frame: not the mapping (``MappedSpan.close``)
                raise block_error(self.storage.url, self.tag, self.path, rec, block_start, block_end, found)
            lo, hi = max(block_start, start), min(block_end, end)
            yield lo, block[lo - block_start : hi - block_start]

    def _checked_run(
        self, f: BinaryIO, run: list[tuple[int, int, str]], scratch: memoryview, start: int, end: int
    ) -> tuple[int, memoryview]:
        """Consecutive whole blocks read into ``scratch`` in one request and checked; the part of them inside
        ``[start, end)``."""
        first = run[0][0]
        self._read_blocks(lambda: f, list(run), scratch, first)
        lo, hi = max(first, start), min(run[-1][1], end)
        return lo, scratch[lo - first : hi - first]

    def _check_end(self, end: int) -> None:
        """IntegrityError when bytes up to ``end`` are needed but the record says fewer were written."""
        rec = self.record
        if rec is not None and end > rec.size:
            raise IntegrityError(
                f"{self.where}: bytes up to {end} are needed but only {rec.size} were written (see "
                f"{layout.manifest_file(self.tag, rec.rank)}); {RESTORE_HINT}"
            )

    def _read_blocks(self, stream: Any, blocks: list[tuple[int, int, str]], view: memoryview, base: int) -> None:
        """Read ``blocks`` (consecutive, whole) into ``view`` (which starts at byte ``base``) in one request, then
        check each; ``blocks`` is emptied. Local files are read a block at a time (each hashed while it is still
        in the CPU cache); ranged storage (S3) a run at a time (one request per run, not per block)."""
        if not blocks:
            return
        first, last = blocks[0][0], blocks[-1][1]
        rec = self.record
        assert rec is not None
        self._read_raw(stream(), first, view[first - base : last - base], rec)
        for block_start, block_end, digest in blocks:
            found = hash_bytes(view[block_start - base : block_end - base])[1]
            if found != digest:
                raise block_error(self.storage.url, self.tag, self.path, rec, block_start, block_end, found)
        blocks.clear()

    def _read_raw(self, f: BinaryIO, start: int, view: memoryview, rec: FileRecord | None) -> int:
        f.seek(start)
        n = read_fully(f, view)
        with self._lock:
            self.bytes_read += n
        if n < len(view):
            if rec is not None:
                raise block_error(self.storage.url, self.tag, self.path, rec, start, start + len(view), n)
            raise FormatError(
                f"{self.where} is truncated: bytes up to {start + len(view)} are needed but it has {start + n}; "
                f"{RESTORE_HINT}"
            )
        return n

    def _read_block(self, stream: Any, start: int, end: int, digest: str, view: memoryview) -> None:
        rec = self.record
        assert rec is not None
        self._read_raw(stream(), start, view, rec)
        found = hash_bytes(view)[1]
        if found != digest:
            raise block_error(self.storage.url, self.tag, self.path, rec, start, end, found)

    def _kept_block(self, stream: Any, start: int, end: int, digest: str) -> np.ndarray:
        """A block a range covers only in part: read and checked once, kept for the range next to it."""
        with self._lock:
            block = self._kept.get(start)
            if block is not None:
                self._kept.move_to_end(start)
                return block
        block = np.empty(end - start, dtype=np.uint8)
        self._read_block(stream, start, end, digest, memoryview(block))
        with self._lock:
            self._kept[start] = block
            while len(self._kept) > self.kept_blocks:
                self._kept.popitem(last=False)
        return block

    def _check_whole(self, rec: FileRecord) -> None:
        """An older record: the whole file hashed and checked, once."""
        with self._lock:
            if self._whole_checked:
                return
            with self.storage.open_read(self.path) as f:
                size, digest = hash_stream(f)
            self.bytes_read += size
            check_record(self.storage.url, self.tag, self.path, rec, size, digest)
            self._whole_checked = True

    def stream(self, start: int = 0, end: int | None = None) -> VerifiedStream:
        """A seekable stream over bytes ``[start, end)`` (to the recorded or actual end when None)."""
        if end is None:
            end = self.record.size if self.record is not None else self.storage.size(self.path)
        return VerifiedStream(self, start, end)


class MappedSpan:
    """A read-only mapping of part of a ``VerifiedFile``'s local file (the page cache's pages, no copy), checked
    piece by piece (``check``, on any thread) with each piece's pages locked in memory (``pages.lock``): what
    was checked stays the bytes used later (``pieces``, ``view``), never dropped and read from the disk again,
    so it is not checked twice. Where a lock was refused (``RLIMIT_MEMLOCK``), what is used is checked again.
    The file must not be changed in place or truncated meanwhile: writers never do that, they replace files
    whole. The mapping (and its locks) goes when the span and every view of it are gone."""

    def __init__(self, file: VerifiedFile, data: np.ndarray, base: int) -> None:
        self.file, self.data, self.base = file, data, base
        self.locked = True
        """Whether every piece checked so far kept its pages in memory."""

    def check(self, start: int, end: int) -> None:
        """Lock and check the blocks holding ``[start, end)``."""
        rec = self.file.record
        assert rec is not None
        blocks = rec.blocks_over(start, end)
        first, last = blocks[0][0] - self.base, blocks[-1][1] - self.base
        address = self.data.__array_interface__["data"][0]
        if not pages.lock(address + first, address + last):
            self.locked = False
        for _ in self.file._checked_blocks(self.data, self.base, start, end):
            pass
        self.file._count(last - first, again=False)

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, np.ndarray]]:
        """Bytes ``[start, end)`` (checked by ``check`` before) as consecutive pieces: in one piece where they
        stayed locked, else a block at a time, each checked again first."""
        if self.locked:
            yield start, self.data[start - self.base : end - self.base]
            return
        self.file._count(end - start, again=True)
        yield from self.file._checked_blocks(self.data, self.base, start, end)

    def close(self) -> None:
        """Unmap now, its pages unlocked (not whenever the collector finds it): once nothing uses the span. A
        view still held elsewhere keeps the mapping until that view goes."""
        data, self.data = self.data, None
        view = data.base if data is not None else None  # np.frombuffer's memoryview of the mmap
        mapping = view.obj if isinstance(view, memoryview) else None
        del data
        if isinstance(mapping, mmap.mmap):
            with contextlib.suppress(BufferError):
                view.release()  # type: ignore[union-attr]
                mapping.close()

    def view(self, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` in one array (checked again first where they did not stay locked)."""
        for _ in self.pieces(start, end) if not self.locked else ():
            pass
        return self.data[start - self.base : end - self.base]


class VerifiedStream(io.RawIOBase):
    """A seekable read-only stream over bytes ``[start, end)`` of a ``VerifiedFile`` (a zip reader parses an
    item's header through it: every byte it sees is checked)."""

    def __init__(self, file: VerifiedFile, start: int, end: int) -> None:
        super().__init__()
        self.file, self._start, self._end = file, start, end
        self._pos = 0
        self.error: Exception | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._end - self._start}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._end - self._start - self._pos))
        try:
            self.file.read_into(self._start + self._pos, view[:n])
        except Exception as e:
            self.error = e  # torch's zip reader replaces it with an error of its own: see ``parsing``
            raise
        self._pos += n
        return n

    @contextlib.contextmanager
    def parsing(self) -> Iterator[VerifiedStream]:
        """Parse through this stream: a failed check raises as itself, not as what the parser made of it
        (``torch._C.PyTorchFileReader`` reports any exception of its stream as a missing ``read``)."""
        try:
            yield self
        except Exception:
            if self.error is not None:
                raise self.error from None
            raise
