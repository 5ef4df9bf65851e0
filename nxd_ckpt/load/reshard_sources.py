"""The source side of a re-sharded load (``load/reshard.py``): the saved layout and sharding record, the saved
files read a block of a tensor at a time by byte range, and the assembly of a target tensor from those blocks.

A plain ``torch.save`` file is read by its zip records' byte ranges, an xser file's tensor files whole (through the
verifying storage) or in parts by range. Memory stays about one target tensor plus one block read.

Integrity: a whole file read here is checked against the tag's manifests as usual; a part of a file read by
range is checked by the blocks holding it (``VerifiedFile``: the manifests' block digests) before it is used, and a
file whose manifest predates block digests is checked whole on its first read. Files of a tag written without
manifests (by NxD itself) are read as before, unchecked. A re-sharded rank reads parts of many source ranks'
files, chosen by the tensors it covers, so its verifying storage holds the tag's whole manifest index (sent with
the description in ``candidates.resolve``: O(world) bytes per rank, accepted here), not the per-rank share a
same-layout load gets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import statefile
from nxd_ckpt.errors import FormatError, IntegrityError, ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.format.integrity import VerifyingStorage
from nxd_ckpt.format.sharding import (
    Box,
    ShardingRecord,
    TensorSharding,
    block_reads,
    element_ranges,
    narrow_box,
    whole_box,
)
from nxd_ckpt.format.sharding_marks import rebase, record_from_model, record_from_spec
from nxd_ckpt.load import zero1
from nxd_ckpt.serialization import structure as zip_structure
from nxd_ckpt.serialization import xser
from nxd_ckpt.storage import Storage
from nxd_ckpt.storage.range_reads import open_for_partial_reads

Reader = Callable[[int, Box], torch.Tensor]
"""(source TP rank, box of its TP-local tensor) -> that block as a new tensor."""


# ------------------------------------------------------------------------------------------- source files


def _partial(storage: Storage, path: str) -> contextlib.AbstractContextManager[Any]:
    """A seekable stream of ``path`` for reading parts of it: under verification every byte it returns is
    checked first (``VerifiedFile``: by its blocks, or the whole file once for an older manifest)."""
    if isinstance(storage, VerifyingStorage):
        return storage.verified_file(path).stream().parsing()
    return open_for_partial_reads(storage, path)


def _check_size(storage: Storage, path: str) -> None:
    """For a file read in parts under verification: its size must be the one its manifest records (the
    checksum, which covers the whole file, cannot be checked on parts)."""
    if not isinstance(storage, VerifyingStorage):
        return
    rec = storage.record_for(path)
    size = storage.size(path)
    if rec is not None and size != rec.size:
        raise IntegrityError(
            f"{storage.url}/{path} is corrupt: it has {size} bytes but {rec.size} were written (see its manifest); "
            "restore it from a copy or load another tag"
        )


def _zip_structure(storage: Storage, path: str, what: str, trusted: bool) -> tuple[Any, dict[str, int]]:
    """A torch.save file's structure (tensors on ``meta``, tagged with their record) and each record's data
    offset in the file; only the zip directory and ``data.pkl`` are read (checked, where the tag has block
    digests)."""
    with _partial(storage, path) as f:
        return zip_structure.load_layout(f, what, trusted)


def _read_runs(
    storage: Storage, path: str, base: int, runs: list[tuple[int, int]], out: torch.Tensor, what: str
) -> None:
    """Fill contiguous ``out`` with the element runs (offset, count) starting at byte ``base`` of the file; under
    verification each run is checked before it lands in ``out``."""
    size = out.element_size()
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    pos = 0
    if isinstance(storage, VerifyingStorage):
        checked = storage.verified_file(path)
        for offset, count in runs:
            checked.read_into(base + offset * size, view[pos : pos + count * size])
            pos += count * size
        return
    with open_for_partial_reads(storage, path) as f:
        for offset, count in runs:
            f.seek(base + offset * size)
            want = count * size
            got = 0
            while got < want:
                n = f.readinto(view[pos + got : pos + want])
                if not n:
                    raise FormatError(f"{what} is truncated: a tensor ends past the end of the file")
                got += n
            pos += want


class SourceFile:
    """One saved state file (plain or xser), read a block of a tensor at a time."""

    def __init__(self, storage: Storage, path: str, *, trusted: bool = False) -> None:
        self.storage, self.path, self.trusted = storage, path, trusted
        self.what = f"{storage.url}/{path}"
        if not storage.exists(path):
            raise FormatError(
                f"checkpoint file {self.what} is missing; the checkpoint is damaged or was saved without this state"
            )
        self.is_xser = layout.is_xser_file(storage, path)
        self.info: dict[int, dict[str, Any]] | None = None
        self._offsets: dict[str, int] = {}
        self._tensor_files: dict[int, tuple[torch.Tensor, dict[str, int]]] = {}
        if self.is_xser:
            self.structure, self.info = statefile.read_xser_reference(storage, path, trusted=trusted)
        else:
            _check_size(storage, path)
            self.structure, self._offsets = _zip_structure(storage, path, self.what, trusted)

    def lookup(self, keys: Sequence[Any]) -> Any:
        """The value at ``keys`` (a tensor on ``meta``, an xser reference, or a plain value); FormatError naming
        the path when the file does not hold it."""
        obj = self.structure
        for k in keys:
            try:
                obj = obj[k]
            except (KeyError, IndexError, TypeError):
                shown = "/".join(map(str, keys))
                raise FormatError(
                    f"{self.what} has no entry {shown!r}; it does not match the checkpoint's record"
                ) from None
        return obj

    def has(self, keys: Sequence[Any]) -> bool:
        """Whether the file holds an entry at ``keys``."""
        try:
            self.lookup(keys)
        except FormatError:
            return False
        return True

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` (from ``lookup``) is a tensor: on ``meta`` or an xser reference."""
        return isinstance(value, torch.Tensor) or xser.is_reference(value)

    def meta(self, value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of a tensor value, without reading its data (a tensor file's structure at most)."""
        return xser.tensor_meta(value, self.info, lambda tid: self._tensor_file(tid)[0])

    def _tensor_path(self, tid: int) -> str:
        """The path of xser tensor file ``tid``; FormatError when it is missing."""
        path = layout.xser_tensor_file(self.path, tid)
        if not self.storage.exists(path):
            raise FormatError(
                f"tensor file {self.storage.url}/{path} is missing, but {self.what} refers to it; the checkpoint "
                "is incomplete or damaged"
            )
        return path

    def _tensor_file(self, tid: int) -> tuple[torch.Tensor, dict[str, int]]:
        """xser tensor file ``tid``'s structure and record offsets (size-checked, read once per file)."""
        if tid not in self._tensor_files:
            path = self._tensor_path(tid)
            _check_size(self.storage, path)
            t, offsets = _zip_structure(self.storage, path, f"{self.storage.url}/{path}", False)
            if not isinstance(t, torch.Tensor):
                raise FormatError(f"{self.storage.url}/{path} does not hold a tensor (found {type(t).__name__})")
            self._tensor_files[tid] = (t, offsets)
        return self._tensor_files[tid]

    def read_box(self, value: Any, box: Box) -> torch.Tensor:
        """The block ``box`` of a tensor value as a new contiguous CPU tensor; only its bytes are read."""
        _dtype, shape = self.meta(value)
        if isinstance(value, torch.Tensor) and value.device.type != "meta":  # inline (xser) or already loaded
            return narrow_box(value, box).clone()
        if not isinstance(value, torch.Tensor):
            tid = int(value.tid)
            if box == whole_box(shape):  # the whole tensor file: read (and verified) as one file
                path = self._tensor_path(tid)
                buffer = self.storage.read_buffer(path)  # one read, checked against the manifest when verifying
                tensor = xser.load_tensor_buffer(buffer, what=f"{self.storage.url}/{path}")
                xser.check_against_info(tid, tensor, self.info, what=f"{self.storage.url}/{path}")
                return tensor
            meta, offsets = self._tensor_file(tid)
            return self._read_meta(meta, offsets, box, self._tensor_path(tid))
        return self._read_meta(value, self._offsets, box, self.path)

    def _read_meta(self, meta: torch.Tensor, offsets: dict[str, int], box: Box, path: str) -> torch.Tensor:
        """The block ``box`` of the tensor ``meta`` describes in the zip file at ``path``, read by byte range."""
        key = getattr(meta.untyped_storage(), zip_structure.RECORD_ATTR, None)
        if key is None or key not in offsets:
            raise FormatError(f"{self.storage.url}/{path}: a tensor's data record is not in the file's zip directory")
        out = torch.empty(tuple(hi - lo for lo, hi in box), dtype=meta.dtype)
        base = offsets[key] + meta.storage_offset() * meta.element_size()
        if meta.is_contiguous():
            runs = element_ranges(tuple(meta.shape), box)
        else:  # a view with its own strides: read the bytes it spans, then take the block
            whole = torch.empty(meta.untyped_storage().nbytes() // meta.element_size(), dtype=meta.dtype)
            _read_runs(self.storage, path, offsets[key], [(0, whole.numel())], whole, self.what)
            viewed = whole.as_strided(meta.shape, meta.stride(), meta.storage_offset())
            return narrow_box(viewed, box).clone()
        _read_runs(self.storage, path, base, runs, out, f"{self.storage.url}/{path}")
        return out

    def value(self, value: Any) -> Any:
        """A plain value as it is, a tensor value read whole (for small state such as ``step``)."""
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if self.is_tensor(value):
            return self.read_box(value, whole_box(self.meta(value)[1]))
        return value


class SourceFiles:
    """The source files of one load, each opened (structure read) once."""

    def __init__(self, storage: Storage, *, trusted: bool) -> None:
        self.storage, self.trusted = storage, trusted
        self._open: dict[str, SourceFile] = {}

    def get(self, path: str) -> SourceFile:
        """The file at ``path``, opened on first use."""
        if path not in self._open:
            self._open[path] = SourceFile(self.storage, path, trusted=self.trusted)
        return self._open[path]


# ------------------------------------------------------------------------------------------- assembly


def fill(
    out: torch.Tensor,
    sharding: TensorSharding,
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
    read: Reader,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Fill ``out``, rows ``[r0, r1)`` of target TP rank ``dst_rank``'s tensor (all of it when ``rows`` is
    None), from the source shards by the read plan; each block is read once, only what ``out`` covers."""
    for b in block_reads(sharding, src_tp, dst_tp, dst_rank, rows):
        narrow_box(out, b.dst_box).copy_(read(b.src_rank, b.src_box))
    return out


def chunked_reader(rows: int, chunks: Sequence[tuple[SourceFile, Any]]) -> Callable[[Box], torch.Tensor]:
    """Reads boxes of a tensor of ``rows`` rows stored as DP chunks along dim 0 (ZeRO-1 shards, padded;
    one chunk = a whole tensor): each box reads only the rows of the chunks it overlaps."""
    per = zero1.chunk_rows(rows, len(chunks))

    def read(box: Box) -> torch.Tensor:
        (b0, b1), rest = box[0], box[1:]
        first_file, first_value = chunks[0]
        dtype, _ = first_file.meta(first_value)
        out = torch.empty((b1 - b0, *(hi - lo for lo, hi in rest)), dtype=dtype)
        for d, (f, value) in enumerate(chunks):
            lo, hi = max(b0, d * per), min(b1, (d + 1) * per, rows)
            if lo < hi:
                out[lo - b0 : hi - b0].copy_(f.read_box(value, ((lo - d * per, hi - d * per), *rest)))
        return out

    return read


# ------------------------------------------------------------------------------------------- records


@dataclass
class SourceLayout:
    """What a re-sharded load reads from: the saved TP/PP/ZeRO-1 sizes and how each tensor was sharded."""

    tag: str
    tp: int
    pp: int
    record: ShardingRecord
    zero1_dp: int | None = None
    """DP chunks of the ZeRO-1 files (None: not ZeRO-1; 1 for full files)."""
    zero1_full: bool = False


def source_record(
    storage: Storage,
    tag: str,
    info: TagDescription,
    saved: ShardingRecord | None,
    sharding: Any,
    *,
    trusted: bool,
) -> ShardingRecord:
    """The sharding of the saved tensors: ``sharding=`` when given (a ShardingRecord, name patterns -> dim or
    (dim, stride), or a model whose parameters carry NxD's attributes), else the record saved with the tag.
    Patterns and models are applied to the saved (per-rank) shapes, read from the TP-rank-0 model file of every
    PP stage (structure only)."""
    if isinstance(sharding, ShardingRecord):
        return sharding
    if sharding is None and saved is not None:
        return saved
    spec = sharding
    if spec is None:
        raise ReshardError(
            f"checkpoint {storage.url}/{tag} records no sharding (it was written by NxD or an older nxd_ckpt) and "
            "no model or sharding= was given to describe it"
        )
    stages: dict[int, dict[str, tuple[int, ...]]] = {}
    for stage in range(info.pp or 1):
        f = SourceFile(storage, layout.model_file(tag, 0, stage), trusted=trusted)
        if not isinstance(f.structure, dict):
            raise FormatError(f"{f.what} holds a {type(f.structure).__name__}, not a model state dict")
        stages[stage] = {k: f.meta(v)[1] for k, v in f.structure.items() if f.is_tensor(v)}
    tp = info.tp or 1
    if isinstance(spec, Mapping):
        return ShardingRecord.merge(record_from_spec(spec, shapes, tp, stage) for stage, shapes in stages.items())
    if not isinstance(spec, torch.nn.Module):
        raise TypeError(
            "sharding= must be a ShardingRecord, a mapping of name patterns, or a torch.nn.Module; got "
            f"{type(spec).__name__}"
        )
    described = record_from_model(spec, None)
    tensors = {}
    for stage, shapes in stages.items():
        for name, local in shapes.items():
            s = described.get(name)
            if s is None:
                continue  # not in the target model: left out (strict loads name it as unexpected)
            tensors[name] = rebase(s, local, tp).with_stage(stage)
    return ShardingRecord(tensors)
