"""``StorageReader``: DCP's storage reader over the library's storage, checking what was written.

Reads any stock DCP checkpoint (``torch.save`` serialization, no stream transforms). Where the writer left its
records (``nxd_ckpt.dcp.StorageWriter``), every rank checks ``.metadata`` against its record at a fixed place
(``nxd_ckpt/dcp_metadata.json``: no listing) before it is unpickled; a damaged or missing ``.metadata`` raises
IntegrityError naming it (inside ``dcp.load``: the ``CheckpointException`` every rank raises holds it). The
coordinator reads the combined index (``nxd_ckpt/dcp_index.json``, one file whatever the number of ranks) once
while DCP plans the load and hands each rank the records of the files it reads (in the plan's ``storage_data``);
checkpoints written before the index existed are planned from the ranks' manifests.

What a load reads: the byte ranges its plan asks for, rounded to the checksum blocks that hold them
(``manifests.FileRecord.blocks``: one item's bytes are whole blocks, at most 256 KiB each), never a whole file for
one item. A large tensor item's zip header is parsed first (its first, 64 KiB block and its last block) so that a
load of part of a saved chunk (re-sharding onto more ranks) reads only the bytes of that part. The ranges are read
by ``thread_count`` threads, each block hashed right after its read (xxh3 without the GIL).

What is verified when: every block is checked against its digest as it is read, before any of its bytes is used;
values are built and copied into the state dict (a non-tensor value unpickled) only once every range of the
rank's load is read and checked, so a damaged or truncated file raises IntegrityError naming it and leaves every
target as it was. A checkpoint written before block digests (whole-file digests only) has each file it reads
hashed whole and checked first. Without manifests (a checkpoint stock DCP wrote, or one whose ``nxd_ckpt/``
folder is gone) ranges are read unchecked: a truncated file is named; a flipped byte is found only where
``torch.load`` notices it.

With ``memory_tier=`` the folder is read from the memory tier where it holds a complete copy (each rank's files
from its own node's memory, else from a peer node's replica), verified the same way; else from the folder.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import itertools
import os
import pickle
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from nxd_ckpt import knobs, pages
from nxd_ckpt.dcp.place import METADATA, CheckpointPlace, FolderId
from nxd_ckpt.errors import CheckpointError, CheckpointNotFoundError, FormatError, IntegrityError, MissingFileError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.integrity import MappedSpan, VerifiedFile
from nxd_ckpt.format.manifests import (
    HEAD_BYTES,
    RESTORE_HINT,
    FileRecord,
    check_record,
    manifest_paths,
    parse_index,
    parse_manifest,
    read_manifests,
)
from nxd_ckpt.serialization import structure as zip_structure
from nxd_ckpt.storage.base import is_not_found
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.shared import shared_tier
from nxd_ckpt.tier.view import TierView
from nxd_ckpt.tools.dcp_io import unpickle_metadata

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _ReadShare:
    """What the coordinator hands one rank for its reads: the records of its files (None for a checkpoint without
    manifests)."""

    records: dict[str, FileRecord] | None


class StorageReader(FolderId, _DcpStorageReader):
    """Reads a DCP checkpoint folder (a local path; ``s3://`` through the library's storage), verified where the
    checkpoint carries the library's manifests.

    >>> # xdoctest: +SKIP
    >>> dcp.load(state_dict, storage_reader=nxd_ckpt.dcp.StorageReader("/ckpt/step-100"))

    Args:
        path: the checkpoint folder (``checkpoint_id``).
        allow_pickle: unpickle ``.metadata`` with any class (default: torch's own classes only).
        memory_tier: read the folder's copy in the memory tier (``nxd_ckpt.MemoryTier``, as it was saved) where
            one is complete. Collective: every rank builds its reader at the same point (the nodes report what
            they hold).
        timeout: the deadline of the memory tier's steps (default ``NXD_CKPT_TIMEOUT_S``).
        thread_count: threads reading (and checking) each rank's byte ranges in parallel.
        buffer_bytes: the most bytes of a rank's load held until every range of it is checked (default
            ``NXD_CKPT_DCP_LOAD_BUFFER``, 4 GiB). Ranges past it are checked first, then read (and checked)
            again one item at a time as they are used: twice the reads for them, memory one item.
    """

    _PER_PROCESS = ("place", "tier_view")

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_pickle: bool = False,
        memory_tier: MemoryTier | None = None,
        timeout: float | None = None,
        thread_count: int = 4,
        buffer_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if buffer_bytes is not None and (isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int)):
            raise TypeError(f"buffer_bytes must be an int (bytes) or None, got {buffer_bytes!r}")
        self.buffer_bytes = buffer_bytes
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        self.thread_count = thread_count
        self.bytes_read = 0
        """Bytes the last ``read_data`` read from storage (its ranges rounded to blocks)."""
        self.bytes_reused = 0
        """Bytes the last ``read_data`` checked, then used from the page cache (local files past the buffer)."""
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")
        self.allow_pickle = allow_pickle
        self.memory_tier = memory_tier
        self.timeout_s = timeout
        self.tier_view: TierView | None = None
        """The memory tier's copy this reader reads (None: the folder); ``bytes_remote`` counts what came from
        other nodes."""
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load (from ``checkpoint_id`` when given)."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self.place = CheckpointPlace.of(self.path)
            self.tier_view = None
            if self.memory_tier is not None:
                tier = shared_tier(self.memory_tier, self.place.root.url, self.timeout_s)
                self.tier_view = tier.memory_view(self.place.folder, self.timeout_s)
            if self.tier_view is not None:
                self.place = dataclasses.replace(self.place, root=self.tier_view)
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
        self._metadata_error: CheckpointError | None = None

    def read_metadata(self) -> Metadata:
        """DCP's ``.metadata``, checked against its record before it is unpickled: IntegrityError naming it when it
        is damaged, MissingFileError (an IntegrityError) when it is recorded but gone, CheckpointNotFoundError when
        the folder holds no checkpoint. There is no rank-local metadata (``rank=``): the writer never writes it.

        Inside ``dcp.load``, whose planning step would catch the error, log it, ask for rank-local metadata and
        raise a bare AssertionError instead, the error is kept and raised by ``set_up_storage_reader``, in the same
        step: every rank's ``dcp.load`` then raises a ``CheckpointException`` holding it."""
        try:
            return self._read_metadata()
        except CheckpointError as e:
            if not _called_by_dcp_load_planning():
                raise
            self._metadata_error = e
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        root, path = self.place.root, f"{self.place.folder}/{METADATA}"
        where = f"{root.url}/{path}"
        record = self._metadata_record()
        try:
            data = root.read_bytes(path)
        except OSError as e:
            if not is_not_found(e):
                raise
            if self.place.repair():  # a re-save a crash cut between its two renames: finished, then read
                return self._read_metadata()
            if record is None:
                raise CheckpointNotFoundError(
                    f"{self.path} holds no DCP checkpoint (no {METADATA}): the save into it never committed, or the "
                    "path is wrong; load another checkpoint (an interrupted save's older copy, if any, is restored "
                    "by nxd_ckpt.dcp.recover_folder or the next save into this folder)"
                ) from e
            raise MissingFileError(
                f"{where} is missing, but the checkpoint's records list it ({record.size} bytes): the folder was "
                f"altered or the file is not visible yet; {RESTORE_HINT}"
            ) from e
        if record is not None:  # checked before it is unpickled
            check_record(root.url, self.place.folder, path, record, *hash_bytes(data))
        try:
            metadata = unpickle_metadata(io.BytesIO(data), where, allow_pickle=self.allow_pickle)
            if not isinstance(metadata, Metadata):
                raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        except (
            EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError, OverflowError,
            pickle.UnpicklingError,
        ) as e:  # fmt: skip
            problem = f"{type(e).__name__}: {e}"
            raise IntegrityError(f"{where} is damaged and cannot be read ({problem}); {RESTORE_HINT}") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata_record(self) -> FileRecord | None:
        """``.metadata``'s record at its fixed place (one read, no listing); for a checkpoint written before it
        existed (or with it lost), from the manifest of the rank that committed; None for a checkpoint without
        manifests (stock DCP's)."""
        root = self.place.root
        fixed = layout.dcp_metadata_record_file(self.place.folder)
        try:
            data = root.read_bytes(fixed)
        except OSError as e:
            if not is_not_found(e):
                raise
            data = None
        if data is not None:
            record = parse_manifest(data, f"{root.url}/{fixed}")[1].get(METADATA)
            if record is None:
                raise IntegrityError(f"{root.url}/{fixed} holds no record of {METADATA}; {RESTORE_HINT}")
            return record
        for path in manifest_paths(root, self.place.folder):
            records = parse_manifest(root.read_bytes(path), f"{root.url}/{path}")[1]
            if METADATA in records:
                return records[METADATA]
        return None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Raises what ``read_metadata`` kept for ``dcp.load`` (see there), in DCP's planning step."""
        error, self._metadata_error = self._metadata_error, None
        if error is not None:
            raise error
        if metadata.storage_data is None:
            raise FormatError(f"{self.path}/{METADATA} has no storage records; it is not a file-system checkpoint")
        self.storage_data = metadata.storage_data
        self._chunk_sizes = {
            (fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
            for fqn, md in metadata.state_dict_metadata.items()
            for chunk in getattr(md, "chunks", ())
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: read the index once and give each rank the records of the files it reads."""
        index = self._index()
        if not index:
            return [dataclasses.replace(p, storage_data=_ReadShare(None)) for p in plans]
        for info in self.storage_data.values():
            if info.relative_path not in index:
                raise IntegrityError(
                    f"{self.place.root.url}/{self.place.folder}/{info.relative_path} is listed in {METADATA} but "
                    f"not in the records of {self.path}: a rank's records are missing or the folder was altered; "
                    f"{RESTORE_HINT}"
                )
        shares = []
        for plan in plans:
            files = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            shares.append(_ReadShare({f: index[f] for f in files}))
        return [dataclasses.replace(p, storage_data=s) for p, s in zip(plans, shares, strict=True)]

    def _index(self) -> dict[str, FileRecord]:
        """Every file's record: the combined index the commit wrote (one read); for a checkpoint written before it
        existed (or with it lost), every rank's manifest; empty for a checkpoint without records (stock DCP's)."""
        root, path = self.place.root, layout.dcp_index_file(self.place.folder)
        try:
            data = root.read_bytes(path)
        except OSError as e:
            if not is_not_found(e):
                raise
            return read_manifests(root, self.place.folder).raise_first().index
        return parse_index(data, f"{root.url}/{path}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items: only the byte ranges the plan needs, checked before any byte is used.

        Three steps: each large tensor item's zip header is parsed (its record's offset, dtype and strides) to
        find the bytes of the part the plan reads; the ranges are read in parallel (``thread_count``) and each
        block checked right after its read (``VerifiedFile``); only when every range of the load is read and
        checked are the values built and copied into the state dict: a failed check leaves every target as it
        was."""
        share: _ReadShare = plan.storage_data if isinstance(plan.storage_data, _ReadShare) else _ReadShare(None)
        files: dict[str, VerifiedFile] = {}
        pairs: list[tuple[VerifiedFile, Any, ReadItem, bool]] = []
        large: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.length > _WHOLE_ITEM_BYTES:
                large[info.relative_path] = large.get(info.relative_path, 0) + 1
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise FormatError(
                    f"{self.path}/{info.relative_path}: {item.storage_index.fqn} was written through DCP stream "
                    f"transforms ({info.transform_descriptors}), which this reader does not undo; read it with "
                    "FileSystemReader"
                )
            rel = info.relative_path
            if rel not in files:  # a large item's first and last block are kept from its parse to its read
                files[rel] = self._file(rel, share.records, 4 + 2 * large.get(rel, 0))
            chunk = self._chunk_sizes.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
            whole = not any(item.storage_offsets) and chunk == tuple(item.lengths)
            pairs.append((files[rel], info, item, whole))
        budget = self._budget()
        mappings: list[MappedSpan] = []
        with _closing(mappings), ThreadPoolExecutor(self.thread_count, thread_name_prefix="nxd_dcp_read") as pool:
            wanted = _all(pool, lambda p: _locate(*p), pairs)
            held, later = _within(_spans(wanted), budget)
            arena = pages.huge_buffer(sum(span.end - span.start for span in held))  # one mapping, 2 MiB pages
            pieces, at = [], 0
            for span in held:
                pieces += span.pieces(arena[at : at + span.end - span.start])
                at += span.end - span.start
            for span in later:  # a local file's span is mapped: checked where the page cache holds it, kept
                mapping = span.file.map_span(span.start, span.end)
                mappings += [mapping] if mapping is not None else []
                for w in span.members:
                    w.mapping = mapping
                if span.file.record is not None:
                    pieces += span.pieces(None, mapping)
            for span in held + later:
                span.file.prefetch(span.start, span.end)
            _all(pool, _Piece.read, pieces)  # every range of the load read and checked (``later``: not kept)
            kept = [w for span in held for w in span.members]
            built = [_value(w, _target(w.item, planner)) for w in kept]  # every value built before any is used
            on_cpu = [b for b in built if b.target is None or b.target.device.type == "cpu"]
            _all(pool, _Built.copy, on_cpu)
            for b in built:
                b.copy()  # a target off the CPU, on this thread (its device's tracing is not shared)
                b.finish(planner)
            _use_again(pool, [w for span in later for w in span.members], planner, self.thread_count)
        self.bytes_read = sum(f.bytes_read for f in files.values())
        self.bytes_reused = sum(f.bytes_reused for f in files.values())
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _budget(self) -> int:
        """Bytes of this load held until all of it is checked: ``buffer_bytes``, else the knob, else none from
        local files (checked where the page cache holds them, then used from there, checked again: no copy held,
        no fresh memory to fault in) and 4 GiB elsewhere (S3: a second read would be a second download)."""
        if self.buffer_bytes is not None:
            return self.buffer_bytes
        knob = knobs.dcp_load_buffer_bytes()
        if knob is not None:
            return knob
        return 0 if self.place.root.local_path(self.place.folder) is not None else _HELD_BUFFER_BYTES

    def _file(self, rel: str, records: dict[str, FileRecord] | None, kept_blocks: int) -> VerifiedFile:
        """``rel`` for checked range reads: by its record where the checkpoint has manifests."""
        record = None
        if records is not None:
            record = records.get(rel)
            if record is None:
                raise IntegrityError(
                    f"{self.place.root.url}/{self.place.folder}/{rel} is read by this load but in no manifest of "
                    f"{self.path}: a rank's manifest is missing or the folder was altered; {RESTORE_HINT}"
                )
        path = f"{self.place.folder}/{rel}"
        return VerifiedFile(self.place.root, path, record, tag=self.place.folder, kept_blocks=kept_blocks)


@contextlib.contextmanager
def _closing(mappings: list[MappedSpan]) -> Iterator[None]:
    """Unmap the load's mappings as it ends (failed or not), their pages unlocked then, not at some later
    collection."""
    try:
        yield
    finally:
        for mapping in mappings:
            mapping.close()


def _all(pool: ThreadPoolExecutor, fn: Callable[[Any], T], args: list[Any]) -> list[T]:
    """``fn`` of each argument on the pool, results in order; the first failure cancels what has not started
    and is raised (a damaged file stops the load without reading the rest)."""
    futures = [pool.submit(fn, a) for a in args]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


_DCP_LOADER = "torch.distributed.checkpoint.state_dict_loader"


def _called_by_dcp_load_planning() -> bool:
    """Whether ``read_metadata``'s caller is the planning step of DCP's loader (``local_step`` of ``dcp.load``),
    which catches its errors (see ``StorageReader.read_metadata``)."""
    caller = sys._getframe(2)
    return caller.f_code.co_name == "local_step" and caller.f_globals.get("__name__") == _DCP_LOADER


_HELD_BUFFER_BYTES = 4 << 30
"""Default of ``buffer_bytes`` where files are not local (S3, the memory tier)."""
_SCRATCH_BYTES = 1 << 20
"""A thread's buffer for checked pieces (``VerifiedFile.checked_pieces``): small enough to stay in its CPU cache."""
_WHOLE_ITEM_BYTES = 1 << 20
"""Tensor items up to this size are read whole and ``torch.load``ed (parsing their header first saves nothing)."""
_PIECE_BYTES = 16 << 20
"""The most one thread reads in one task: a large range is split at block ends into pieces of about this size."""


@dataclasses.dataclass
class _Wanted:
    """One read item's bytes: ``[start, end)`` of ``file``; ``layout`` the saved tensor part they hold (dtype,
    size, strides in elements from ``start``), None for a whole item (raw bytes, or a tensor ``torch.load``ed)."""

    file: VerifiedFile
    item: ReadItem
    start: int
    end: int
    layout: tuple[torch.dtype, tuple[int, ...], tuple[int, ...]] | None = None
    data: np.ndarray | None = None
    mapping: MappedSpan | None = None
    """The checked mapping of its span (a local file past the buffer), which it is used from."""


def _locate(file: VerifiedFile, info: Any, item: ReadItem, whole_chunk: bool) -> _Wanted:
    """The byte range ``item`` needs: for a large tensor item of which the load reads a part, only the elements
    of that part (its header parsed through the checked stream first), else the whole item."""
    start, end = info.offset, info.offset + info.length
    whole = _Wanted(file, item, start, end)
    if item.type == LoadItemType.BYTE_IO or info.length <= _WHOLE_ITEM_BYTES or whole_chunk:
        return whole
    try:
        found = zip_structure.head_layout(file.read(start, min(end, start + HEAD_BYTES)), file.where)
        if found is None:  # the head alone does not say: the zip directory at the item's end is read too
            with file.stream(start, end).parsing() as stream:
                found = zip_structure.load_layout(stream, file.where)
        saved, offsets = found
    except IntegrityError:
        raise
    except Exception:  # not the plain layout (an unusual torch.save): torch.load reads the whole item instead
        return whole
    return _part(file, item, start, end, saved, offsets) or whole


def _part(
    file: VerifiedFile, item: ReadItem, start: int, end: int, saved: Any, offsets: dict[str, int]
) -> _Wanted | None:
    """The bytes of the part of the saved tensor ``saved`` (its zip records at ``offsets`` from ``start``) that
    ``item`` reads, with their layout; None where it is no plain tensor (``torch.load`` reads the item whole)."""
    key = getattr(saved.untyped_storage(), zip_structure.RECORD_ATTR, None) if torch.is_tensor(saved) else None
    if key not in offsets or saved.layout != torch.strided:
        return None
    part = saved
    for dim, (first, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        part = part.narrow(dim, first, length)
    if part.numel() == 0:
        return None
    size = part.element_size()
    extent = 1 + sum((n - 1) * stride for n, stride in zip(part.size(), part.stride(), strict=True))
    first_byte = start + offsets[key] + part.storage_offset() * size
    if start + offsets[key] + saved.untyped_storage().nbytes() > end or extent * size > end - first_byte:
        raise IntegrityError(f"{file.where}: {item.storage_index.fqn}'s tensor record runs past its item")
    return _Wanted(file, item, first_byte, first_byte + extent * size, (part.dtype, part.size(), part.stride()))


@dataclasses.dataclass
class _Span:
    """Overlapping or touching ranges of one file, read into one buffer."""

    file: VerifiedFile
    start: int
    end: int
    members: list[_Wanted]

    def pieces(self, buffer: np.ndarray | None, mapping: MappedSpan | None = None) -> list[_Piece]:
        """The span's reads for the thread pool, each about ``_PIECE_BYTES``, split where a block ends; into
        ``buffer`` (the span's bytes, which its members then use), else (None) each into a scratch buffer of its
        own, dropped once checked."""
        for w in self.members if buffer is not None else ():
            w.data = buffer[w.start - self.start : w.end - self.start]
        cuts = [self.start]
        record = self.file.record
        ends = record.block_ends if record is not None and record.blocks else None
        while cuts[-1] < self.end:
            cut = min(self.end, cuts[-1] + _PIECE_BYTES)
            if ends is not None and cut < self.end:
                cut = min(self.end, ends[min(len(ends) - 1, bisect.bisect_left(ends, cut))])
            cuts.append(cut)
        view = memoryview(buffer) if buffer is not None else None
        return [
            _Piece(self.file, a, b, view[a - self.start : b - self.start] if view is not None else None, mapping)
            for a, b in itertools.pairwise(cuts)
        ]


@dataclasses.dataclass
class _Piece:
    """Bytes ``[start, end)`` of ``file``, read and checked into ``view``; else checked in ``mapping`` (its span's,
    a local file), else read into a scratch buffer, checked and dropped."""

    file: VerifiedFile
    start: int
    end: int
    view: memoryview | None
    mapping: MappedSpan | None = None

    def read(self) -> None:
        if self.view is not None:
            self.file.read_into(self.start, self.view)
        elif self.mapping is not None:
            self.mapping.check(self.start, self.end)
        else:
            for _ in self.file.checked_pieces(self.start, self.end, _scratch(_SCRATCH_BYTES)):
                pass


_per_thread = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """``nbytes`` of this thread's scratch buffer, reused while it is large enough: memory the process already
    has is written at memory speed, fresh memory costs a page fault per page (far more on a VM whose host takes
    freed memory back)."""
    buffer: np.ndarray | None = getattr(_per_thread, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _per_thread.buffer = np.empty(nbytes, dtype=np.uint8)
    return memoryview(buffer)[:nbytes]


def _use_again(pool: ThreadPoolExecutor, items: list[_Wanted], planner: LoadPlanner, threads: int) -> None:
    """The items of ranges already checked whole but not kept, each checked again as it is used: mapped from the
    page cache where the file is local (no copy, no fresh memory), else read again; copied into its target on
    the pool (a CPU target) or on this thread (a target off the CPU, whose device's tracing is not shared), at
    most ``2 * threads`` items ahead of this thread."""
    window = 2 * threads

    def read(w: _Wanted, target: torch.Tensor | None) -> _Built:
        if w.mapping is not None:
            if _streamed(w, target, w.mapping):
                return _Built(w.item, target)
            data = w.mapping.view(w.start, w.end)
        else:
            data = w.file.read(w.start, w.end)
        w.data = data
        built = _value(w, target)
        w.data = None
        if target is None or target.device.type == "cpu":
            built.copy()
        return built

    futures: list[Any] = []

    def use(n: int) -> None:
        built = futures[n].result()
        built.copy()
        built.finish(planner)

    try:
        for n, w in enumerate(items):
            if n >= window:
                use(n - window)
            futures.append(pool.submit(read, w, _target(w.item, planner)))
        for n in range(max(0, len(items) - window), len(items)):
            use(n)
    except BaseException:
        for future in futures:
            future.cancel()
        raise


def _streamed(w: _Wanted, target: torch.Tensor | None, mapping: MappedSpan) -> bool:
    """Copy ``w``'s tensor bytes into ``target`` straight from the page cache's mapping of its file (checked),
    where they are laid out exactly as the target's; False (nothing copied) elsewhere."""
    if target is None or target.device.type != "cpu" or w.item.type == LoadItemType.BYTE_IO:
        return False
    pieces = mapping.pieces(w.start, w.end)
    part, first = w, None
    if w.layout is None:  # a whole item: its head (in the first piece) says where its tensor's bytes are
        first = next(pieces, None)
        found = zip_structure.head_layout(first[1][:HEAD_BYTES], w.file.where) if first is not None else None
        part = _part(w.file, w.item, w.start, w.end, *found) if found is not None else None
    dest = _flat_bytes(target, part) if part is not None else None
    if part is None or dest is None:
        pieces.close()
        return False
    for at, piece in itertools.chain([first] if first is not None else [], pieces):
        lo, hi = max(at, part.start), min(at + len(piece), part.end)
        if hi > lo:
            dest[lo - part.start : hi - part.start] = piece[lo - at : hi - at]
    return True


def _flat_bytes(target: torch.Tensor, w: _Wanted) -> np.ndarray | None:
    """The bytes of ``target`` as one flat array where ``w``'s saved part is laid out exactly as they are (a CPU
    target, contiguous, of the part's dtype and size, the part contiguous too): its bytes are then copied in as
    read. None otherwise (the part is built as a tensor and copied)."""
    if w.layout is None or target.device.type != "cpu" or not target.is_contiguous():
        return None
    dtype, size, stride = w.layout
    if target.dtype != dtype or tuple(target.size()) != tuple(size) or target.numel() == 0:
        return None
    if any(n > 1 and st != want for n, st, want in zip(size, stride, _contiguous_strides(size), strict=True)):
        return None
    if target.numel() * target.element_size() != w.end - w.start:
        return None
    return target.reshape(-1).view(torch.uint8).numpy()


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``size``."""
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _within(spans: list[_Span], budget: int) -> tuple[list[_Span], list[_Span]]:
    """The spans held in memory until the load is checked (in order, while they fit ``budget`` bytes), and the
    rest, which are checked first and read again when used."""
    held: list[_Span] = []
    total = 0
    for n, span in enumerate(spans):
        if total + span.end - span.start > budget:
            return held, spans[n:]
        held.append(span)
        total += span.end - span.start
    return held, []


def _spans(wanted: list[_Wanted]) -> list[_Span]:
    """The ranges of each file in file order, overlapping or touching ones merged."""
    spans: list[_Span] = []
    for w in sorted(wanted, key=lambda w: (id(w.file), w.start)):
        last = spans[-1] if spans else None
        if last is not None and last.file is w.file and w.start <= last.end:
            last.end = max(last.end, w.end)
            last.members.append(w)
        else:
            spans.append(_Span(w.file, w.start, w.end, [w]))
    return spans


class _BufferStream(io.RawIOBase):
    """A seekable read-only stream over a buffer, without copying it (``io.BytesIO`` would): torch.load reads
    each record straight out of it with ``readinto``."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        target = memoryview(b).cast("B")
        n = max(0, min(len(target), len(self._view) - self._pos))
        target[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _saved_tensor(data: np.ndarray, where: str, item: ReadItem) -> torch.Tensor:
    """The tensor an item's ``torch.save`` bytes hold: a view of its data in ``data`` where the layout is the plain
    one (no copy: the caller copies it into the target), else ``torch.load``ed."""
    view = _plain_view(data, where)
    if view is not None:
        return view
    try:
        return torch.load(_BufferStream(memoryview(data)), map_location="cpu", weights_only=True)
    except Exception as e:  # only files without a record get here damaged: nothing checked them
        raise FormatError(
            f"{where}: {item.storage_index.fqn} cannot be read ({type(e).__name__}: {e}); {RESTORE_HINT}"
        ) from e


def _plain_view(data: np.ndarray, where: str) -> torch.Tensor | None:
    """A view of the one tensor a ``torch.save`` blob holds, in place; None for any other layout (a subclass, a
    quantized or empty tensor, an unreadable blob: ``torch.load`` then reads it, or says what is wrong)."""
    try:
        found = zip_structure.head_layout(data[:HEAD_BYTES], where)  # the zip's own headers, no directory walk
        saved, offsets = found or zip_structure.load_layout(_BufferStream(memoryview(data)), where)
    except Exception:
        return None
    key = getattr(saved.untyped_storage(), zip_structure.RECORD_ATTR, None) if torch.is_tensor(saved) else None
    if key not in offsets or saved.layout != torch.strided:
        return None
    start, nbytes = offsets[key], saved.untyped_storage().nbytes()
    if nbytes == 0 or start + nbytes > len(data):
        return None
    raw = torch.frombuffer(memoryview(data[start : start + nbytes]), dtype=saved.dtype)
    return raw.as_strided(saved.size(), saved.stride(), saved.storage_offset())


@dataclasses.dataclass
class _Built:
    """One item's value built from its checked bytes: ``copy`` puts a tensor into its target (on any thread for
    a CPU target), ``finish`` tells the planner (on the loading thread: the planner is not shared across threads)."""

    item: ReadItem
    target: torch.Tensor | None
    tensor: torch.Tensor | None = None
    raw: bytes | None = None

    def copy(self) -> None:
        if self.tensor is not None and self.target is not None:
            self.target.copy_(self.tensor)
        self.tensor = None

    def finish(self, planner: LoadPlanner) -> None:
        if self.raw is not None:
            planner.load_bytes(self.item, io.BytesIO(self.raw))
        elif self.target is not None:
            planner.commit_tensor(self.item, self.target)


def _target(item: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
    """Where a tensor item goes (the planner asked on the loading thread); None for a non-tensor value."""
    return None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()


def _value(wanted: _Wanted, target: torch.Tensor | None) -> _Built:
    """One item's value from its checked bytes (a view of them: copy it before they change), for ``target``."""
    item, data = wanted.item, wanted.data
    assert data is not None
    if target is None:
        return _Built(item, None, raw=data.tobytes())
    if wanted.layout is not None:
        dtype, size, stride = wanted.layout
        tensor = torch.frombuffer(memoryview(data), dtype=dtype).as_strided(size, stride)
    else:
        tensor = _saved_tensor(data, wanted.file.where, item)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)  # the part of the saved chunk this item reads
    if target.size() != tensor.size():
        raise FormatError(
            f"{item.storage_index.fqn}: saved chunk {tuple(tensor.size())} does not fit {tuple(target.size())}"
        )
    return _Built(item, target, tensor)
