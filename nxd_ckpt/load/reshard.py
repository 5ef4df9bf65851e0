"""Loading a checkpoint into another TP, PP or DP layout than the one it was saved with.

Every tensor a target rank needs is assembled from the parts of the source shards it covers
(``format/sharding.py`` read plans), read by byte range: a plain ``torch.save`` file's zip records by range, an
xser file's tensor files (whole ones through the verifying storage; parts of one by range). Memory stays about
one target tensor plus one block read. Parameters follow their names to the pipeline stage that holds them now;
optimizer state follows its parameter (state with the parameter's shape is re-sharded like it; ``step`` and other
scalars are copied); ZeRO-1 state is first the TP-local tensor cut in DP chunks along dim 0 (``load/zero1.py``),
so a ZeRO-1 shard of the new layout reads only the rows and columns it covers.

Everything that makes a layout impossible (no sharding recorded for a tensor, a layout the arithmetic does not
cover, shapes that disagree with the target) is found by ``plan_*`` before any tensor data is read.

Integrity: a whole file read here is checked against the tag's manifests as usual; a part of a file read by
range cannot be (the checksum covers the whole file): such files are checked against their recorded size only
(``nxd-ckpt verify`` checks the whole tag). A re-sharded rank reads parts of many source ranks' files, chosen
by the tensors it covers, so its verifying storage holds the tag's whole manifest index (sent with the description in
``candidates.resolve``: O(world) bytes per rank, accepted here), not the per-rank share a same-layout load gets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import adapters, statefile
from nxd_ckpt.errors import FormatError, IntegrityError, ReshardError, StateMismatchError
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
    read_plan,
    rebase,
    record_from_model,
    record_from_spec,
    whole_box,
)
from nxd_ckpt.inspect import open_for_partial_reads
from nxd_ckpt.load import zero1
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.serialization import structure as zip_structure
from nxd_ckpt.serialization import torchzip, xser
from nxd_ckpt.storage import Storage

Reader = Callable[[int, Box], torch.Tensor]
"""(source TP rank, box of its TP-local tensor) -> that block as a new tensor."""


# ------------------------------------------------------------------------------------------- source files


def _raw(storage: Storage) -> Storage:
    """The storage under the verifying layer, for reads of parts of a file (a checksum covers whole files)."""
    return storage.inner if isinstance(storage, VerifyingStorage) else storage


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
    offset in the file; only the zip directory and ``data.pkl`` are read."""
    keys: list[str] = []

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        untyped = torch.UntypedStorage(nbytes, device="meta")
        setattr(untyped, zip_structure.RECORD_ATTR, key)
        keys.append(key)
        return untyped

    with open_for_partial_reads(storage, path) as f:
        reader, pickled = torchzip.open_zip(f, what)
        if reader.has_record("byteorder") and reader.get_record("byteorder") not in (b"little", "little"):
            raise FormatError(f"{what} was written on a big-endian machine; it cannot be re-sharded by range")
        state = torchzip.load_records(pickled, source, what=what, trusted=trusted)
        offsets = {k: reader.get_record_offset(f"data/{k}") for k in keys}
    return state, offsets


def _read_runs(
    storage: Storage, path: str, base: int, runs: list[tuple[int, int]], out: torch.Tensor, what: str
) -> None:
    """Fill contiguous ``out`` with the element runs (offset, count) starting at byte ``base`` of the file."""
    size = out.element_size()
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    pos = 0
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
            self.structure, self._offsets = _zip_structure(_raw(storage), path, self.what, trusted)

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
        try:
            self.lookup(keys)
        except FormatError:
            return False
        return True

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) or xser._is_reference(value)

    def meta(self, value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of a tensor value, without reading its data."""
        if isinstance(value, torch.Tensor):
            return value.dtype, tuple(value.shape)
        tid = int(value.tid)
        recorded = xser.info_meta(self.info, tid)
        if recorded is not None:
            return recorded
        t, _ = self._tensor_file(tid)
        return t.dtype, tuple(t.shape)

    def _tensor_path(self, tid: int) -> str:
        path = layout.xser_tensor_file(self.path, tid)
        if not self.storage.exists(path):
            raise FormatError(
                f"tensor file {self.storage.url}/{path} is missing, but {self.what} refers to it; the checkpoint "
                "is incomplete or damaged"
            )
        return path

    def _tensor_file(self, tid: int) -> tuple[torch.Tensor, dict[str, int]]:
        if tid not in self._tensor_files:
            path = self._tensor_path(tid)
            _check_size(self.storage, path)
            t, offsets = _zip_structure(_raw(self.storage), path, f"{self.storage.url}/{path}", False)
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
        key = getattr(meta.untyped_storage(), zip_structure.RECORD_ATTR, None)
        if key is None or key not in offsets:
            raise FormatError(f"{self.storage.url}/{path}: a tensor's data record is not in the file's zip directory")
        out = torch.empty(tuple(hi - lo for lo, hi in box), dtype=meta.dtype)
        base = offsets[key] + meta.storage_offset() * meta.element_size()
        if meta.is_contiguous():
            runs = element_ranges(tuple(meta.shape), box)
        else:  # a view with its own strides: read the bytes it spans, then take the block
            whole = torch.empty(meta.untyped_storage().nbytes() // meta.element_size(), dtype=meta.dtype)
            _read_runs(_raw(self.storage), path, offsets[key], [(0, whole.numel())], whole, self.what)
            viewed = whole.as_strided(meta.shape, meta.stride(), meta.storage_offset())
            return narrow_box(viewed, box).clone()
        _read_runs(_raw(self.storage), path, base, runs, out, f"{self.storage.url}/{path}")
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


# ------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TensorJob:
    """One target tensor: its name, its sharding, the PP stage whose files hold it, dtype and target shape."""

    name: str
    sharding: TensorSharding
    stage: int


def plan_model(
    record: ShardingRecord,
    src_tp: int,
    src_pp: int,
    topo: Topology,
    target: Mapping[str, Any],
    *,
    strict: bool,
    where: str,
) -> list[TensorJob]:
    """The tensors this rank loads, checked (sharding known and re-shardable, target shapes right) before any
    data is read; tensors of the target without a record are an error under ``strict``, else skipped."""
    jobs = []
    for name, value in target.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name not in record and not strict:
            continue
        s = record.require(name, where)
        s.check(name, topo.tp_size, src_tp)
        stage = s.pp_stage or 0
        if stage >= src_pp:
            raise FormatError(
                f"{where}: tensor {name!r} is recorded on PP stage {stage}, but the checkpoint has {src_pp}"
            )
        want = s.local_shape(topo.tp_size)
        if tuple(value.shape) != want:
            raise StateMismatchError(
                f"{where}: tensor {name!r} has global shape {list(s.shape)}, so at TP={topo.tp_size} each rank "
                f"holds {list(want)}, but the model's is {list(value.shape)}"
            )
        jobs.append(TensorJob(name, s, stage))
    return jobs


def _checked(f: SourceFile, value: Any, name: str, want: tuple[int, ...]) -> torch.dtype:
    if not f.is_tensor(value):
        raise FormatError(f"{f.what}: {name!r} is a {type(value).__name__}, not a tensor")
    dtype, shape = f.meta(value)
    if shape != want:
        raise FormatError(
            f"{f.what}: tensor {name!r} has shape {list(shape)}, but its recorded sharding says {list(want)}; the "
            "checkpoint is damaged or its sharding record does not match it"
        )
    return dtype


def load_model(
    src: SourceLayout,
    jobs: Sequence[TensorJob],
    topo: Topology,
    files: SourceFiles,
    live: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's model state at its layout, assembled from the source model files: straight into the
    ``live`` model's CPU tensors where they fit (no second copy of the state), else into fresh memory."""
    live = live or {}
    out = {}
    for job in jobs:

        def file_of(tp_rank: int, job: TensorJob = job) -> SourceFile:
            return files.get(layout.model_file(src.tag, tp_rank, job.stage))

        def read(tp_rank: int, box: Box, job: TensorJob = job) -> torch.Tensor:
            f = file_of(tp_rank)
            return f.read_box(f.lookup((job.name,)), box)

        first = file_of(read_plan(job.sharding, src.tp, topo.tp_size, topo.tp_rank)[0].src_rank)
        dtype = _checked(first, first.lookup((job.name,)), job.name, job.sharding.local_shape(src.tp))
        shape = job.sharding.local_shape(topo.tp_size)
        dest = live.get(job.name)
        if (
            dest is not None
            and dest.device.type == "cpu"
            and dest.dtype == dtype
            and tuple(dest.shape) == shape
            and dest.is_contiguous()
        ):
            tensor = dest.detach()  # the parameter's own memory (load_state_dict then copies it onto itself)
        else:
            tensor = torch.empty(shape, dtype=dtype)
        with torch.no_grad():
            out[job.name] = fill(tensor, job.sharding, src.tp, topo.tp_size, topo.tp_rank, read)
    return out


# ------------------------------------------------------------------------------------------- optimizer


@dataclass(frozen=True)
class OptimizerJob:
    """Target optimizer index ``index`` takes the state of parameter ``name`` (source stage and index)."""

    index: int
    name: str
    sharding: TensorSharding
    stage: int
    src_index: int


def plan_optimizer(
    record: ShardingRecord, src_tp: int, src_pp: int, topo: Topology, target_order: Sequence[str | None], where: str
) -> list[OptimizerJob]:
    """Which saved optimizer state each of this rank's optimizer indices takes, checked before reading."""
    jobs = []
    for index, name in enumerate(target_order):
        if name is None:
            raise ReshardError(
                f"optimizer parameter {index} is not a parameter of the model passed to load_checkpoint, so its "
                "state cannot be matched to the saved state at another layout"
            )
        s = record.require(name, where)
        s.check(name, topo.tp_size, src_tp)
        stage = s.pp_stage or 0
        order = record.optimizer_params.get(stage)
        if order is None:
            raise ReshardError(
                f"{where} does not record the optimizer's parameter order of PP stage {stage}, so optimizer state "
                "cannot be re-sharded; load the model alone (and start the optimizer fresh)"
            )
        if name not in order:
            raise ReshardError(f"{where}: parameter {name!r} had no optimizer state on PP stage {stage}")
        jobs.append(OptimizerJob(index, name, s, stage, order.index(name)))
    return jobs


def _groups(
    first: SourceFile, target_groups: Sequence[Sequence[int]], where: str, key: str = "param_groups"
) -> list[dict]:
    saved = first.value(first.lookup((key,)))
    if not isinstance(saved, list) or len(saved) != len(target_groups):
        raise ReshardError(
            f"{where}: the saved optimizer has {len(saved) if isinstance(saved, list) else '?'} parameter groups, "
            f"this one {len(target_groups)}; re-sharding keeps the groups"
        )
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(ids)}
        for g, ids in zip(saved, target_groups, strict=True)
    ]


def _walk_slots(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_slots(v, (*path, k))
    else:
        yield path, obj


def _set(tree: dict, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_optimizer(
    src: SourceLayout,
    jobs: Sequence[OptimizerJob],
    target_groups: Sequence[Sequence[int]],
    topo: Topology,
    files: SourceFiles,
) -> dict:
    """This rank's plain (torch) optimizer state at its layout: state shaped like the parameter is re-sharded
    like it, the rest (``step``) copied from one source."""
    where = f"{files.storage.url}/{src.tag}"
    state: dict[int, dict] = {}
    first_file = None
    for job in jobs:

        def path_of(tp_rank: int, job: OptimizerJob = job) -> str:
            return layout.optim_file(src.tag, 0, tp_rank, job.stage)

        base = files.get(path_of(read_plan(job.sharding, src.tp, topo.tp_size, topo.tp_rank)[0].src_rank))
        first_file = first_file or base
        if not base.has(("state", job.src_index)):
            continue
        entry: dict = {}
        src_local = job.sharding.local_shape(src.tp)
        for slot, value in _walk_slots(base.lookup(("state", job.src_index))):
            if base.is_tensor(value) and base.meta(value)[1] == src_local and src_local:
                keys = ("state", job.src_index, *slot)

                def read(tp_rank: int, box: Box, keys: tuple = keys, path_of: Callable = path_of) -> torch.Tensor:
                    f = files.get(path_of(tp_rank))
                    return f.read_box(f.lookup(keys), box)

                out = torch.empty(job.sharding.local_shape(topo.tp_size), dtype=base.meta(value)[0])
                _set(entry, slot, fill(out, job.sharding, src.tp, topo.tp_size, topo.tp_rank, read))
            else:
                _set(entry, slot, base.value(value))
        state[job.index] = entry
    if first_file is None:
        first_file = files.get(layout.optim_file(src.tag, 0, 0, 0))
    return {"state": state, "param_groups": _groups(first_file, target_groups, where)}


@dataclass(frozen=True)
class _Zero1Source:
    """The ZeRO-1 files of a tag, re-cut for this rank: its DP rows of its TP part of a parameter's state."""

    src: SourceLayout
    topo: Topology
    files: SourceFiles

    def paths(self, tp_rank: int, stage: int) -> list[str]:
        """The files holding TP rank ``tp_rank``'s state of ``stage``, in DP order (one when saved full)."""
        src = self.src
        if src.zero1_full:
            return [layout.full_optim_file(src.tag, tp_rank, stage)]
        return [layout.optim_file(src.tag, d, tp_rank, stage) for d in range(int(src.zero1_dp or 1))]

    def base_file(self, job: OptimizerJob) -> SourceFile:
        """The first file this rank's part of ``job`` is read from (its structure describes every slot)."""
        first = read_plan(job.sharding, self.src.tp, self.topo.tp_size, self.topo.tp_rank)[0]
        return self.files.get(self.paths(first.src_rank, job.stage)[0])

    def recut(self, job: OptimizerJob, keys: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor at ``keys`` of ``job``'s parameter, as this rank's padded ZeRO-1 shard."""
        topo = self.topo
        src_local = job.sharding.local_shape(self.src.tp)
        dst_local = job.sharding.local_shape(topo.tp_size)
        rows = zero1.shard_rows(dst_local[0], topo.zero1_size, topo.zero1_rank)
        readers: dict[int, Callable[[Box], torch.Tensor]] = {}

        def read(tp_rank: int, box: Box) -> torch.Tensor:
            if tp_rank not in readers:
                chunks = [(f, f.lookup(keys)) for f in (self.files.get(p) for p in self.paths(tp_rank, job.stage))]
                readers[tp_rank] = chunked_reader(src_local[0], chunks)
            return readers[tp_rank](box)

        out = torch.zeros(zero1.shard_shape(dst_local, topo.zero1_size), dtype=dtype)
        fill(out.narrow(0, 0, rows[1] - rows[0]), job.sharding, self.src.tp, topo.tp_size, topo.tp_rank, read, rows)
        return out

    def entry(self, job: OptimizerJob, base: SourceFile) -> dict:
        """``job``'s base-state entry: sharded slots re-cut, the others (step counts...) as saved."""
        entry: dict = {}
        for slot, value in _walk_slots(base.lookup((zero1.BASE_STATE, job.src_index))):
            keys = (zero1.BASE_STATE, job.src_index, *slot)
            if base.is_tensor(value) and zero1.is_shard_slot(keys, len(base.meta(value)[1])):
                _set(entry, slot, self.recut(job, keys, base.meta(value)[0]))
            else:
                _set(entry, slot, base.value(value))
        return entry


def load_zero1(
    src: SourceLayout,
    jobs: Sequence[OptimizerJob],
    target_groups: Sequence[Sequence[int]],
    topo: Topology,
    files: SourceFiles,
) -> dict:
    """This rank's ZeRO-1 optimizer state (its DP chunk of every TP-local parameter) at its layout."""
    source = _Zero1Source(src, topo, files)
    base_state: dict[int, dict] = {}
    shape_info: dict[int, list[int]] = {}
    masters: dict[int, torch.Tensor] = {}
    first_file: SourceFile | None = None
    has_masters = False
    for job in jobs:
        base = source.base_file(job)
        first_file = first_file or base
        saved_shape = tuple(int(d) for d in base.value(base.lookup((zero1.SHAPE_INFO, job.src_index))))
        if saved_shape != job.sharding.local_shape(src.tp):
            raise FormatError(
                f"{base.what}: shape_info of {job.name!r} is {list(saved_shape)}, but its recorded sharding says "
                f"{list(job.sharding.local_shape(src.tp))}"
            )
        shape_info[job.index] = list(job.sharding.local_shape(topo.tp_size))
        base_state[job.index] = source.entry(job, base)
        if base.has((zero1.MASTER_WEIGHTS, job.src_index)):
            has_masters = True
            keys = (zero1.MASTER_WEIGHTS, job.src_index)
            masters[job.index] = source.recut(job, keys, base.meta(base.lookup(keys))[0])
    if first_file is None:
        first_file = files.get(source.paths(0, 0)[0])
    out: dict[str, Any] = {}
    for key, value in first_file.structure.items():
        if key not in (zero1.BASE_STATE, zero1.SHAPE_INFO, zero1.MASTER_WEIGHTS, "param_groups"):
            out[key] = first_file.value(value)
    out["param_groups"] = _groups(first_file, target_groups, f"{files.storage.url}/{src.tag}")
    out[zero1.BASE_STATE] = base_state
    out[zero1.SHAPE_INFO] = shape_info
    if has_masters:
        out[zero1.MASTER_WEIGHTS] = masters
    return out


# ------------------------------------------------------------------------------------------- one load


def _target_order(model: Any, optimizer: Any, tp: int) -> tuple[list[str | None], list[list[int]]]:
    """The parameter name behind each of the target optimizer's state indices, and its groups' indices."""
    inner = optimizer.optimizer if type(optimizer).__name__ == "NxDOptimizer" else optimizer
    groups = getattr(inner, "param_groups", None)
    if not isinstance(model, torch.nn.Module) or not groups:
        raise ReshardError(
            "re-sharding optimizer state on load needs the model (a torch.nn.Module) and an optimizer with "
            "param_groups, to match each optimizer parameter to its name"
        )
    order = list(record_from_model(model, tp, optimizer=optimizer).optimizer_params.get(0, ()))
    index, ids = 0, []
    for g in groups:
        n = len(g.get("params", []))
        ids.append(list(range(index, index + n)))
        index += n
    return order, ids


class ReshardedLoad:
    """One rank's load at another TP/PP (and DP) layout, planned and checked on creation (nothing read but
    the structure of the files), then read by ``model_state`` / ``optimizer_state``."""

    def __init__(
        self,
        storage: Storage,
        tag: str,
        info: TagDescription,
        record: ShardingRecord,
        topo: Topology,
        model: Any,
        optimizer: Any,
        *,
        strict: bool,
        trusted: bool,
    ) -> None:
        self.topo = topo
        self.files = SourceFiles(storage, trusted=trusted)
        where = f"{storage.url}/{tag}"
        self.src = SourceLayout(
            tag, int(info.tp or 1), int(info.pp or 1), record, zero1_dp=info.zero1_dp_size, zero1_full=info.zero1_full
        )
        self.zero1 = bool(info.zero1)
        self.model_jobs: list[TensorJob] = []
        self.live: dict[str, torch.Tensor] = {}
        self.opt_jobs: list[OptimizerJob] = []
        self.groups: list[list[int]] = []
        if model is not None:
            if isinstance(model, torch.nn.Module):
                target: Mapping[str, Any] = adapters.model_state(model)
                self.live = dict(model.named_parameters(remove_duplicate=False))
                self.live.update(model.named_buffers(remove_duplicate=False))
            elif self.src.pp == topo.pp_size:  # a dict target: this stage's tensors, at their new shapes
                target = {
                    n: torch.empty(record.tensors[n].local_shape(topo.tp_size), device="meta")
                    for n in record.names_on_stage(topo.pp_rank)
                }
            else:
                raise ReshardError(
                    f"loading {where} at another PP size needs the model (a torch.nn.Module), to know which "
                    "parameters this stage holds now"
                )
            self.model_jobs = plan_model(record, self.src.tp, self.src.pp, topo, target, strict=strict, where=where)
        if optimizer is not None:
            if self.zero1 and info.zero1_dp_size is None and not info.zero1_full:
                raise ReshardError(
                    f"{where}: the ZeRO-1 optimizer files' DP size is not known; it cannot be re-sharded"
                )
            order, self.groups = _target_order(model, optimizer, topo.tp_size)
            self.opt_jobs = plan_optimizer(record, self.src.tp, self.src.pp, topo, order, where)

    def model_state(self) -> dict[str, torch.Tensor]:
        return load_model(self.src, self.model_jobs, self.topo, self.files, self.live)

    def optimizer_state(self) -> dict:
        if self.zero1:
            return load_zero1(self.src, self.opt_jobs, self.groups, self.topo, self.files)
        return load_optimizer(self.src, self.opt_jobs, self.groups, self.topo, self.files)
