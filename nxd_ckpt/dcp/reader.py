"""``StorageReader``: DCP's storage reader over the library's storage, checking what was written.

Reads any stock DCP checkpoint (``torch.save`` serialization, no stream transforms). Where the writer left its
records (``nxd_ckpt.dcp.StorageWriter``), every rank checks ``.metadata`` against its record at a fixed place
(``nxd_ckpt/dcp_metadata.json``: no listing) before it is unpickled; a damaged or missing ``.metadata`` raises
IntegrityError naming it (inside ``dcp.load``: the ``CheckpointException`` every rank raises holds it). The
coordinator reads the combined index (``nxd_ckpt/dcp_index.json``, one file whatever the number of ranks) once
while DCP plans the load and hands each rank the records of the files it reads (in the plan's ``storage_data``);
checkpoints written before the index existed are planned from the ranks' manifests. Each rank then reads every such file
once, front to back (``open_sequential``, as DCP's FileSystemReader reads without threads), hashing each piece as
it arrives and parsing each item from a buffer of that item alone (memory held: the largest item, not a file),
and checks the file's size and xxh3_64 digest (``integrity.VerifyingStorage``) at its end, before any of its
items is committed or a non-tensor value loaded: a truncated or corrupted file raises IntegrityError naming it
(tensor bytes have been copied into the state dict by then, as with stock DCP; the load fails). Without manifests
(a checkpoint stock DCP wrote, or one whose ``nxd_ckpt/`` folder is gone) every file the metadata points into must
hold the bytes it points at: a truncated file is named too; a flipped byte is found only where ``torch.load``
notices it.

With ``memory_tier=`` the folder is read from the memory tier where it holds a complete copy (each rank's files
from its own node's memory, else from a peer node's replica), verified the same way; else from the folder.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from nxd_ckpt.dcp.place import METADATA, CheckpointPlace, FolderId
from nxd_ckpt.errors import CheckpointError, CheckpointNotFoundError, FormatError, IntegrityError, MissingFileError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.integrity import VerifyingStorage
from nxd_ckpt.format.manifests import (
    RESTORE_HINT,
    FileRecord,
    IndexShare,
    check_record,
    manifest_paths,
    parse_index,
    parse_manifest,
    read_manifests,
)
from nxd_ckpt.storage.base import is_not_found, read_fully
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.shared import shared_tier
from nxd_ckpt.tier.view import TierView
from nxd_ckpt.tools.dcp_io import unpickle_metadata


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_pickle: bool = False,
        memory_tier: MemoryTier | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
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
        """Read this rank's items, file by file, each file once front to back (checked in the same pass, where it
        has a record, before any item of it is committed)."""
        share: _ReadShare = plan.storage_data if isinstance(plan.storage_data, _ReadShare) else _ReadShare(None)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise FormatError(
                    f"{self.path}/{info.relative_path}: {item.storage_index.fqn} was written through DCP stream "
                    f"transforms ({info.transform_descriptors}), which this reader does not undo; read it with "
                    "FileSystemReader"
                )
            per_file.setdefault(info.relative_path, []).append(item)
        scratch = _Scratch()
        for rel, items in per_file.items():
            self._read_file(rel, items, share.records, planner, scratch)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(
        self, rel: str, items: list[ReadItem], records: dict[str, FileRecord] | None, planner: LoadPlanner,
        scratch: _Scratch,
    ) -> None:  # fmt: skip
        """``rel``'s items into the state dict from one sequential read of the file. With a record, every byte is
        hashed as it is read and the file checked at the end (IntegrityError naming it, before anything that
        failed to parse is reported and before any item is committed)."""
        folder = self.place.folder
        path = f"{folder}/{rel}"
        storage = self.place.root
        if records is not None:
            storage = VerifyingStorage(self.place.root, folder, IndexShare(records, frozenset([rel])))
        commits: list[Callable[[], None]] = []
        failure: Exception | None = None
        with storage.open_sequential(path) as stream:
            try:
                self._serve(stream, path, items, planner, scratch, commits)
            except Exception as e:  # damaged bytes mostly fail to parse; the check as the block ends names them
                failure = e
        if failure is not None:
            raise failure
        for commit in commits:
            commit()

    def _serve(
        self, stream: BinaryIO, path: str, items: list[ReadItem], planner: LoadPlanner, scratch: _Scratch,
        commits: list[Callable[[], None]],
    ) -> None:  # fmt: skip
        """Read ``stream`` front to back, span by span (the byte ranges of the items, overlapping ones merged),
        skipping the gaps, and hand each item its bytes; commits are queued in ``commits``."""
        position = 0
        for start, end, span_items in _spans([(self.storage_data[i.storage_index], i) for i in items]):
            if start > position:
                position += _skip(stream, start - position, scratch)
            view = scratch.view(end - start)
            got = read_fully(stream, view) if position == start else 0
            position += got
            if got != end - start:
                raise FormatError(
                    f"{self.place.root.url}/{path} is truncated: {METADATA} points at bytes up to {end} but it has "
                    f"{position}; {RESTORE_HINT}"
                )
            for info, item in span_items:
                commits.append(_apply(planner, item, view[info.offset - start : info.offset + info.length - start]))


_DCP_LOADER = "torch.distributed.checkpoint.state_dict_loader"


def _called_by_dcp_load_planning() -> bool:
    """Whether ``read_metadata``'s caller is the planning step of DCP's loader (``local_step`` of ``dcp.load``),
    which catches its errors (see ``StorageReader.read_metadata``)."""
    caller = sys._getframe(2)
    return caller.f_code.co_name == "local_step" and caller.f_globals.get("__name__") == _DCP_LOADER


class _Scratch:
    """One reusable buffer for the span being parsed: memory held is the largest item, not a whole file."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def view(self, size: int) -> memoryview:
        if self._buffer.nbytes < size:
            self._buffer = np.empty(0, dtype=np.uint8)  # the old one freed first
            self._buffer = np.empty(size, dtype=np.uint8)
        return memoryview(self._buffer)[:size]


def _spans(pairs: list[tuple[Any, ReadItem]]) -> list[tuple[int, int, list[tuple[Any, ReadItem]]]]:
    """The items' byte ranges in file order, overlapping ones merged: ``(start, end, [(info, item)])``."""
    spans: list[tuple[int, int, list[tuple[Any, ReadItem]]]] = []
    for info, item in sorted(pairs, key=lambda p: p[0].offset):
        end = info.offset + info.length
        if spans and info.offset < spans[-1][1]:
            start, last_end, members = spans[-1]
            spans[-1] = (start, max(last_end, end), [*members, (info, item)])
        else:
            spans.append((info.offset, end, [(info, item)]))
    return spans


def _skip(stream: BinaryIO, count: int, scratch: _Scratch) -> int:
    """Read (and so hash, on a checked stream) ``count`` bytes nobody uses; returns how many there were."""
    done = 0
    while done < count:
        view = scratch.view(min(count - done, 1 << 20))
        n = read_fully(stream, view)
        done += n
        if n < len(view):
            break
    return done


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


def _apply(planner: LoadPlanner, item: ReadItem, data: memoryview) -> Callable[[], None]:
    """One item's bytes into the state dict, as DCP's FileSystemReader does; returns the commit, which the caller
    makes once the file is checked (a non-tensor item is loaded only then)."""
    if item.type == LoadItemType.BYTE_IO:
        kept = bytes(data)  # the buffer is reused for the next span
        return lambda: planner.load_bytes(item, io.BytesIO(kept))
    tensor = torch.load(_BufferStream(data), map_location="cpu", weights_only=True)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)  # the part of the saved chunk this item reads
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise FormatError(
            f"{item.storage_index.fqn}: saved chunk {tuple(tensor.size())} does not fit {tuple(target.size())}"
        )
    target.copy_(tensor)
    return lambda: planner.commit_tensor(item, target)
