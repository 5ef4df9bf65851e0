"""The whole (unsharded) model state of a tag saved at any TP/PP layout, one tensor at a time, with verified reads.

Each parameter is found in the model files of the PP stage that holds it; a tensor-parallel one is read from
every TP rank's file and merged (``format/sharding.merge``: the one owner of how a tensor is split), a replicated
one from TP rank 0. How each tensor is split comes from, in this order: the caller (a ``ShardingRecord``, a
name-pattern spec, or a model whose parameters carry NxD's attributes), the ``sharding`` record nxd_ckpt saves
in ``nxd_ckpt.json``, or, at TP=1, nothing (every file holds whole tensors). A tensor whose split is not known
fails before anything is read, naming it.

Reads are verified: every file a tensor comes from is checked once, whole, against the tag's manifests before
the first range of it is used (tags NxD wrote have no manifests: read as they are).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import BinaryIO

import torch

from nxd_ckpt.errors import FormatError, ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format import sharding as shd
from nxd_ckpt.format import sharding_marks as marks
from nxd_ckpt.format.integrity import VerifyingStorage
from nxd_ckpt.format.manifests import hash_stream
from nxd_ckpt.inspection import Checkpoint, ObjectInfo
from nxd_ckpt.storage import Storage
from nxd_ckpt.tools.safetensors_io import TensorEntry
from nxd_ckpt.tools.user_files import read_json_object

ShardingSource = shd.ShardingRecord | Mapping[str, marks.SpecValue] | torch.nn.Module | None
"""What a caller may pass to say how tensors are split: a record, name patterns -> dim / (dim, stride) / None,
or a model whose parameters carry NxD's tensor-parallel attributes."""


def read_sharding_spec(path: str) -> dict[str, marks.SpecValue]:
    """A sharding spec file: JSON ``{"name pattern": dim | [dim, stride] | null, ...}`` (fnmatch globs, first
    match wins; null: replicated), as ``format/sharding_marks.record_from_spec`` takes it."""
    doc = read_json_object(path, "sharding spec", "a JSON object of name pattern -> partition dim")
    spec: dict[str, marks.SpecValue] = {}
    for pattern, value in doc.items():
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            spec[pattern] = value
        elif isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
            spec[pattern] = (value[0], value[1])
        else:
            raise ValueError(
                f"sharding spec {path}: {pattern!r} -> {value!r}; use a partition dim (0), [dim, stride] ([0, 3]) "
                "or null (replicated)"
            )
    return spec


class VerifyOnceStorage(VerifyingStorage):
    """Checks each file with a manifest record once, whole (streamed, bounded memory), before its first ranged
    read; whole-file reads are checked as ``VerifyingStorage`` does."""

    def __init__(self, inner: Storage, tag: str) -> None:
        super().__init__(inner, tag)
        self._checked: set[str] = set()
        self._checked_lock = threading.Lock()

    def _ensure_checked(self, path: str) -> None:
        rec = self.record_for(path)
        if rec is None:
            return
        with self._checked_lock:
            if path in self._checked:
                return
        with self.inner.open_read(path) as f:
            size, digest = hash_stream(f)
        self._check(path, rec, size, digest)
        with self._checked_lock:
            self._checked.add(path)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset or length is not None:
            self._ensure_checked(path)
            return self.inner.read_bytes(path, offset, length)
        return super().read_bytes(path, offset, length)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._checked_lock:
            done = path in self._checked
        if done:
            with self.inner.open_read(path) as f:
                yield f
            return
        with super().open_read(path) as f:
            with self._checked_lock:
                self._checked.add(path)
            yield f


class CheckpointModel:
    """The model state of one tag as whole tensors: ``entries()`` up front (no data read), ``read(name)``."""

    def __init__(self, ckpt: Checkpoint, sharding: ShardingSource = None, *, verify: bool = True) -> None:
        if verify:
            ckpt = Checkpoint(VerifyOnceStorage(ckpt.storage, ckpt.tag), ckpt.tag, allow_pickle=ckpt.allow_pickle)
        self.ckpt = ckpt
        desc = ckpt.description()
        if desc.ep > 1:
            raise ReshardError(
                f"{ckpt.url} was saved with expert parallelism (EP={desc.ep}); its expert tensors are split over EP "
                "ranks, which the offline tools do not merge; load it with the same parallel sizes"
            )
        model_files = [sf for sf in ckpt.state_files() if sf.prefix.startswith(layout.MODEL_DIR + "/")]
        if not model_files:
            raise FormatError(f"{ckpt.url} holds no model state (no files under {layout.MODEL_DIR}/)")
        self.tp, self.pp = desc.tp or 1, desc.pp or 1
        # (tp, pp) -> the object path prefix of its model file
        self._prefix: dict[tuple[int, int], str] = {}
        for sf in model_files:
            name = sf.path.rsplit("/", 1)[1]
            coord = layout.parse_state_file_name(name)
            if coord is None:
                raise FormatError(f"{ckpt.url}: unexpected model file {sf.path}")
            self._prefix[(coord[1], coord[2])] = sf.prefix
        missing = [(t, p) for p in range(self.pp) for t in range(self.tp) if (t, p) not in self._prefix]
        if missing:
            files = ", ".join(layout.model_file(ckpt.tag, t, p) for t, p in missing[:4])
            raise FormatError(f"{ckpt.url} is missing model files of its TP={self.tp} PP={self.pp} layout: {files}")
        # Names and local metadata from TP rank 0's file of each stage; values (non-tensors) are listed apart.
        self._local: dict[str, ObjectInfo] = {}
        self._stage: dict[str, int] = {}
        self.skipped: list[str] = []
        for pp in range(self.pp):
            prefix = self._prefix[(0, pp)]
            for obj in ckpt.objects(prefix):
                name = obj.path[len(prefix) + 1 :]
                if obj.kind != "tensor":
                    self.skipped.append(obj.path)
                    continue
                if name in self._stage:
                    raise ReshardError(
                        f"{ckpt.url}: tensor {name!r} is in the model files of PP stages {self._stage[name]} and "
                        f"{pp}; pipeline stages should hold disjoint tensors (tied weights are not merged)"
                    )
                self._local[name], self._stage[name] = obj, pp
        self.record = self._resolve(sharding)
        for name in self._local:
            self.record.require(name, ckpt.url).check(name, self.tp)
            self._check_shape(name)

    # ------------------------------------------------------------------------------------------ sharding
    def _resolve(self, given: ShardingSource) -> shd.ShardingRecord:
        """The sharding of every tensor at the saved TP (global shapes from the local ones)."""
        local_shapes = {n: tuple(o.shape or ()) for n, o in self._local.items()}
        if isinstance(given, shd.ShardingRecord):
            base = given
        elif isinstance(given, torch.nn.Module):
            base = marks.record_from_model(given, self.tp)
        elif isinstance(given, Mapping):
            tensors: dict[str, shd.TensorSharding] = {}
            for pp in range(self.pp):
                names = {n: s for n, s in local_shapes.items() if self._stage[n] == pp}
                tensors.update(marks.record_from_spec(given, names, self.tp, pp).tensors)
            return shd.ShardingRecord(tensors)
        elif given is None:
            meta = self.ckpt.description().metadata
            recorded = getattr(meta, "sharding", None) if meta is not None else None
            if recorded is not None and recorded.tensors:
                base = recorded
            elif self.tp == 1:
                return shd.ShardingRecord(
                    {n: shd.TensorSharding(s, pp_stage=self._stage[n]) for n, s in local_shapes.items()}
                )
            else:
                raise ReshardError(
                    f"{self.ckpt.url} was saved at TP={self.tp} without a sharding record (written by NxD or an "
                    "older nxd_ckpt), so it is not known along which dimension each tensor was split; pass a "
                    "sharding spec (--sharding-spec FILE with name patterns -> partition dim, e.g. "
                    '{"*.qkv_proj.weight": [0, 3], "*.o_proj.weight": 1, "*": null}) or, from Python, a model '
                    "whose parameters carry NxD's tensor-parallel attributes"
                )
        else:
            raise TypeError(f"sharding must be a ShardingRecord, a pattern mapping or a model, got {type(given)}")
        tensors = {}
        for name, local in local_shapes.items():
            s = base.get(name)
            if s is not None:
                if s.partition_dim is not None and s.num_partitions != self.tp and given is None:
                    raise ReshardError(
                        f"{self.ckpt.url}: the recorded sharding of {name!r} is for TP={s.num_partitions}, but the "
                        f"files are TP={self.tp}"
                    )
                tensors[name] = marks.rebase(s, local, self.tp).with_stage(self._stage[name])
        return shd.ShardingRecord(tensors)

    def _check_shape(self, name: str) -> None:
        s = self.record.require(name, self.ckpt.url)
        local = tuple(self._local[name].shape or ())
        if s.local_shape(self.tp) != local:
            raise ReshardError(
                f"{self.ckpt.url}: tensor {name!r} is {list(local)} in its TP rank 0 file, but its sharding "
                f"({s.to_json()}) gives {list(s.local_shape(self.tp))} per rank at TP={self.tp}"
            )

    # ------------------------------------------------------------------------------------------ reading
    def entries(self) -> list[TensorEntry]:
        """Every tensor (global name, dtype, global shape), PP stage by stage in file order."""
        out = []
        for name, obj in self._local.items():
            dtype = getattr(torch, obj.dtype or "")
            out.append(TensorEntry(name, dtype, self.record.require(name).shape))
        return out

    def stage_of(self, name: str) -> int:
        return self._stage[name]

    def sharding_of(self, name: str) -> shd.TensorSharding:
        return self.record.require(name, self.ckpt.url)

    @property
    def largest_tensor_bytes(self) -> int:
        return max((e.nbytes for e in self.entries()), default=0)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor: TP rank 0's copy if replicated, else every TP rank's shard merged."""
        s = self.sharding_of(name)
        pp = self._stage[name]
        if s.replicated:
            first = self._read_local(name, 0, pp)
            for tp in range(1, self.tp):  # copies that differ mean the record is wrong: never pick one silently
                if not _same_bits(first, self._read_local(name, tp, pp)):
                    raise ReshardError(
                        f"{self.ckpt.url}: tensor {name!r} is described as replicated over TP ranks, but TP rank "
                        f"{tp}'s copy differs from TP rank 0's; it is split or the ranks diverged: pass a sharding "
                        "spec that gives its partition dim"
                    )
            return first
        shards = [self._read_local(name, tp, pp) for tp in range(self.tp)]
        full = shd.merge(shards, s)
        del shards
        return full

    def _read_local(self, name: str, tp: int, pp: int) -> torch.Tensor:
        path = f"{self._prefix[(tp, pp)]}/{name}"
        try:
            tensor = self.ckpt.read(path)
        except KeyError as e:
            raise FormatError(f"{self.ckpt.url}: {name!r} is in TP rank 0's file of PP stage {pp} but not in TP rank "
                              f"{tp}'s ({e})") from e  # fmt: skip
        if not isinstance(tensor, torch.Tensor):
            raise FormatError(f"{self.ckpt.url}: {path} is not a tensor in TP rank {tp}'s file")
        return tensor


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
