"""How each tensor of a model is sharded across tensor-parallel (TP) ranks: the one owner of that concept.

NxD's parallel layers mark each parameter with ``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``num_partitions`` and ``rank_ordering``
(``neuronx_distributed/parallel_layers/utils.py: set_tensor_model_parallel_attributes``). The layout they stand
for is NxD's ``create_local_weight``: the global tensor is cut along ``partition_dim`` into ``TP * stride``
equal chunks and chunk ``i`` goes to TP rank ``i % TP``, so rank ``r`` holds chunks ``r, r + TP, ...`` back to
back (stride 1: one contiguous block; stride 2 or 3: fused gate/up or Q/K/V projections). Tensors without the
marks are replicated: every TP rank holds the whole tensor.

This module holds that layout as values (``TensorSharding``, ``ShardingRecord``, recorded in ``nxd_ckpt.json``
under ``sharding``) and the pure arithmetic on it: which global index ranges a rank holds, ``split``, ``merge``,
and read plans saying which parts (pieces, or blocks of a tensor and their element runs) of which source shards a
target rank needs. Records are obtained in ``format/sharding_marks.py``. Nothing here reads files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nxd_ckpt.errors import FormatError, ReshardError
from nxd_ckpt.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # nxd_ckpt.json is read by commands that never touch a tensor (nxd-ckpt list)

# ----------------------------------------------------------------------------------------------------- values


@dataclass(frozen=True)
class TensorSharding:
    """How one tensor is laid out over the TP ranks of the job that saved it."""

    shape: tuple[int, ...]
    """The global (unsharded) shape."""
    partition_dim: int | None = None
    """The dimension cut across TP ranks; None: replicated (every TP rank holds the whole tensor)."""
    stride: int = 1
    """NxD's ``partition_stride``: each rank holds ``stride`` chunks dealt round-robin (fused projections)."""
    num_partitions: int = 1
    """How many TP ranks the tensor was cut into when it was saved (1 for replicated tensors)."""
    pp_stage: int | None = None
    """The pipeline stage that held the tensor when it was saved (None: not known, i.e. PP = 1 or unrecorded)."""
    rank_ordering: tuple[int, ...] | None = None
    """NxD's ``rank_ordering`` when one was set (only the identity order can be re-sharded)."""
    unsupported: str | None = None
    """Why this tensor cannot be re-sharded (e.g. KV heads replicated across TP ranks); None when it can."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.rank_ordering is not None:
            object.__setattr__(self, "rank_ordering", tuple(int(r) for r in self.rank_ordering))

    @property
    def replicated(self) -> bool:
        return self.partition_dim is None

    def with_stage(self, pp_stage: int | None) -> TensorSharding:
        return replace(self, pp_stage=pp_stage)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape each of ``tp`` ranks holds (the global shape when replicated)."""
        if self.partition_dim is None:
            return self.shape
        out = list(self.shape)
        out[self.partition_dim] = self.shape[self.partition_dim] // tp
        return tuple(out)

    def problem(self, tp: int) -> str | None:
        """Why this tensor cannot be laid out over ``tp`` ranks, or None when it can."""
        if self.unsupported:
            return self.unsupported
        if self.rank_ordering is not None and list(self.rank_ordering) != sorted(self.rank_ordering):
            return (
                f"it has NxD rank_ordering {list(self.rank_ordering)}, which nxd_ckpt does not re-shard (only the "
                "identity order)"
            )
        if self.partition_dim is None:
            return None
        if not 0 <= self.partition_dim < len(self.shape):
            return f"partition_dim {self.partition_dim} is outside its {len(self.shape)}-d shape {list(self.shape)}"
        size, pieces = self.shape[self.partition_dim], tp * self.stride
        if self.stride < 1 or size % pieces:
            return (
                f"its dim {self.partition_dim} of size {size} does not split into TP={tp} x stride {self.stride} "
                "equal chunks"
            )
        return None

    def check(self, name: str, tp: int, src_tp: int | None = None) -> None:
        """Raise ReshardError naming ``name`` when the tensor cannot be laid out over ``tp`` ranks (coming from
        ``src_tp`` ranks, when given)."""
        for size in (src_tp, tp):
            why = self.problem(size) if size is not None else None
            if why is not None:
                change = f"from TP={src_tp} to TP={tp}" if src_tp is not None else f"to TP={tp}"
                raise ReshardError(f"tensor {name!r} cannot be re-sharded {change}: {why}")

    # ------------------------------------------------------------------------------------------ encoding
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape)}
        if self.partition_dim is not None:
            out.update(dim=self.partition_dim, stride=self.stride, partitions=self.num_partitions)
        if self.pp_stage is not None:
            out["pp"] = self.pp_stage
        if self.rank_ordering is not None:
            out["rank_ordering"] = list(self.rank_ordering)
        if self.unsupported is not None:
            out["unsupported"] = self.unsupported
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TensorSharding:
        dim = doc.get("dim")
        ordering = doc.get("rank_ordering")
        return cls(
            shape=tuple(int(d) for d in doc["shape"]),
            partition_dim=None if dim is None else int(dim),
            stride=int(doc.get("stride", 1)),
            num_partitions=int(doc.get("partitions", 1)),
            pp_stage=None if doc.get("pp") is None else int(doc["pp"]),
            rank_ordering=None if ordering is None else tuple(int(r) for r in ordering),
            unsupported=None if doc.get("unsupported") is None else str(doc["unsupported"]),
        )


@dataclass(frozen=True)
class ShardingRecord:
    """Every model tensor's sharding (by state-dict name), and each PP stage's optimizer parameter order."""

    tensors: Mapping[str, TensorSharding] = field(default_factory=dict)
    optimizer_params: Mapping[int, tuple[str | None, ...]] = field(default_factory=dict)
    """Per PP stage: the parameter name behind each optimizer state index (None for a parameter the model does
    not name), so optimizer state can follow its parameter to another layout."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", dict(self.tensors))
        object.__setattr__(self, "optimizer_params", {int(k): tuple(v) for k, v in self.optimizer_params.items()})

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ShardingRecord)
            and dict(self.tensors) == dict(other.tensors)
            and dict(self.optimizer_params) == dict(other.optimizer_params)
        )

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.tensors)))

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str) -> TensorSharding | None:
        return self.tensors.get(name)

    def require(self, name: str, where: str = "the checkpoint") -> TensorSharding:
        """The sharding of ``name``; ReshardError naming it when there is none."""
        found = self.tensors.get(name)
        if found is None:
            raise ReshardError(
                f"{where} has no sharding information for tensor {name!r}, so it cannot be re-sharded; pass "
                "sharding=... to load_checkpoint (a model whose parameters carry NxD's tensor-parallel attributes, "
                "or name patterns -> partition dim, e.g. {'*.qkv_proj.weight': (0, 3), '*': None})"
            )
        return found

    def names_on_stage(self, pp_stage: int) -> list[str]:
        return [n for n, s in self.tensors.items() if (s.pp_stage or 0) == pp_stage]

    @staticmethod
    def merge(records: Iterable[ShardingRecord]) -> ShardingRecord:
        """One record from the records of several ranks (PP stages); the same name must agree everywhere."""
        tensors: dict[str, TensorSharding] = {}
        orders: dict[int, tuple[str | None, ...]] = {}
        for rec in records:
            for name, s in rec.tensors.items():
                have = tensors.get(name)
                if have is not None and have != s:
                    raise ReshardError(
                        f"ranks disagree on how tensor {name!r} is sharded ({have} vs {s}); every rank of a stage "
                        "must build the same model"
                    )
                tensors[name] = s
            for stage, order in rec.optimizer_params.items():
                if orders.get(stage, order) != order:
                    raise ReshardError(f"ranks of PP stage {stage} disagree on the optimizer's parameter order")
                orders[stage] = order
        return ShardingRecord(tensors, orders)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensors": {name: s.to_json() for name, s in self.tensors.items()}}
        if self.optimizer_params:
            out["optimizer_params"] = {str(k): list(v) for k, v in sorted(self.optimizer_params.items())}
        return out

    @classmethod
    def from_json(cls, doc: Any, where: str = "nxd_ckpt.json") -> ShardingRecord:
        try:
            if not isinstance(doc, Mapping) or not isinstance(doc.get("tensors", {}), Mapping):
                raise TypeError("'sharding' must be an object with a 'tensors' object")
            tensors = {str(n): TensorSharding.from_json(s) for n, s in doc.get("tensors", {}).items()}
            orders = {int(k): tuple(v) for k, v in (doc.get("optimizer_params") or {}).items()}
            return cls(tensors, orders)
        except (TypeError, ValueError, KeyError) as e:
            raise FormatError(
                f"{where}: 'sharding' is not a valid sharding record ({e}); it was damaged or edited"
            ) from e


# ----------------------------------------------------------------------------------------------- arithmetic


@dataclass(frozen=True)
class Span:
    """Global indices ``[start, stop)`` along the partition dim, held at ``local_start`` of a rank's shard."""

    start: int
    stop: int
    local_start: int


def spans(sharding: TensorSharding, tp: int, rank: int) -> list[Span]:
    """The global index ranges (along ``partition_dim``) TP rank ``rank`` of ``tp`` holds, in local order."""
    if sharding.partition_dim is None:
        raise ValueError("a replicated tensor has no spans: every rank holds all of it")
    if not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside TP size {tp}")
    chunk = sharding.shape[sharding.partition_dim] // (tp * sharding.stride)
    return [Span((rank + k * tp) * chunk, (rank + k * tp + 1) * chunk, k * chunk) for k in range(sharding.stride)]


def split(full: torch.Tensor, sharding: TensorSharding, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of the global tensor ``full`` (a new contiguous tensor)."""
    if tuple(full.shape) != sharding.shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not have the global shape {sharding.shape}")
    if sharding.partition_dim is None:
        return full.clone()
    dim = sharding.partition_dim
    return torch.cat([full.narrow(dim, s.start, s.stop - s.start) for s in spans(sharding, tp, rank)], dim=dim)


def merge(shards: Sequence[torch.Tensor], sharding: TensorSharding) -> torch.Tensor:
    """The global tensor from every TP rank's shard (in TP rank order); replicated: the first one."""
    if sharding.partition_dim is None:
        return shards[0].clone()
    tp, dim = len(shards), sharding.partition_dim
    out = shards[0].new_empty(sharding.shape)
    for rank, shard in enumerate(shards):
        if tuple(shard.shape) != sharding.local_shape(tp):
            raise ValueError(
                f"shard {rank} has shape {tuple(shard.shape)}, expected {sharding.local_shape(tp)} for TP={tp}"
            )
        for s in spans(sharding, tp, rank):
            out.narrow(dim, s.start, s.stop - s.start).copy_(shard.narrow(dim, s.local_start, s.stop - s.start))
    return out


@dataclass(frozen=True)
class Piece:
    """Indices ``[src_start, src_stop)`` along the partition dim of source TP rank ``src_rank``'s shard land at
    ``dst_start`` of the target shard (both local indices). Replicated tensors: one piece, the whole tensor
    (``dim`` None, indices 0)."""

    src_rank: int
    src_start: int
    src_stop: int
    dst_start: int

    @property
    def size(self) -> int:
        return self.src_stop - self.src_start


def pieces_to_read(sharding: TensorSharding, src_tp: int, dst_tp: int, dst_rank: int) -> list[Piece]:
    """What target TP rank ``dst_rank`` of ``dst_tp`` needs from the ``src_tp`` source shards, in target order.

    Replicated tensors are read whole from one source rank (``dst_rank % src_tp``, spreading the reads).
    """
    if sharding.partition_dim is None:
        return [Piece(dst_rank % src_tp, 0, 0, 0)]
    src_spans = [spans(sharding, src_tp, r) for r in range(src_tp)]
    pieces = []
    for want in spans(sharding, dst_tp, dst_rank):
        for rank, have_list in enumerate(src_spans):
            for have in have_list:
                lo, hi = max(want.start, have.start), min(want.stop, have.stop)
                if lo < hi:
                    pieces.append(
                        Piece(rank, have.local_start + lo - have.start, have.local_start + hi - have.start,
                              want.local_start + lo - want.start)
                    )  # fmt: skip
    pieces.sort(key=lambda p: p.dst_start)
    return _coalesce(pieces)


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last is not None
            and last.src_rank == p.src_rank
            and last.src_stop == p.src_start
            and last.dst_start + last.size == p.dst_start
        ):
            out[-1] = Piece(last.src_rank, last.src_start, p.src_stop, last.dst_start)
        else:
            out.append(p)
    return out


Box = tuple[tuple[int, int], ...]
"""A block of a tensor: ``[start, stop)`` along every dimension."""


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(d)) for d in shape)


def element_ranges(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """(offset, count) runs of elements, in order, that a row-major contiguous tensor of ``shape`` stores the
    block ``box`` in (adjacent runs merged): what a reader fetches to get exactly that block."""
    shape = [int(d) for d in shape]
    if len(box) != len(shape):
        raise ValueError(f"box {box} does not have the {len(shape)} dimensions of shape {shape}")
    if any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True)):
        raise ValueError(f"box {box} is outside shape {shape}")
    if any(lo == hi for lo, hi in box):
        return []
    if not shape:
        return [(0, 1)]
    # the innermost dims that the box covers whole form contiguous runs with the first partial dim above them
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1 :])
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    run = (box[k][1] - box[k][0]) * inner
    out: list[tuple[int, int]] = []
    for idx in itertools.product(*(range(lo, hi) for lo, hi in box[:k])):
        offset = sum(i * s for i, s in zip(idx, strides, strict=False)) + box[k][0] * inner
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((offset, run))
    return out


@dataclass(frozen=True)
class BlockRead:
    """Block ``src_box`` of source TP rank ``src_rank``'s shard lands at ``dst_box`` of the target's tensor;
    ``runs`` are the (element offset, count) runs the source shard (row-major, contiguous) stores it in."""

    src_rank: int
    src_box: Box
    dst_box: Box
    runs: tuple[tuple[int, int], ...]


def block_reads(
    sharding: TensorSharding, src_tp: int, dst_tp: int, dst_rank: int, rows: tuple[int, int] | None = None
) -> list[BlockRead]:
    """The read plan of target TP rank ``dst_rank`` of ``dst_tp`` as blocks of the ``src_tp`` source shards:
    exactly the elements it needs, each once. With ``rows``, only rows ``[r0, r1)`` of the target's tensor
    (a ZeRO-1 DP chunk) are wanted, and ``dst_box`` counts rows from ``r0``."""
    src_local, dst_local = sharding.local_shape(src_tp), sharding.local_shape(dst_tp)
    plan = pieces_to_read(sharding, src_tp, dst_tp, dst_rank)
    if not dst_local:
        return [BlockRead(plan[0].src_rank, (), (), ((0, 1),))]
    r0, r1 = rows if rows is not None else (0, dst_local[0])
    if r1 <= r0:
        return []
    dim = sharding.partition_dim
    out = []
    for p in plan:
        src = [(0, n) for n in src_local]
        dst = [(0, n) for n in dst_local]
        if dim == 0:
            lo, hi = max(p.dst_start, r0), min(p.dst_start + p.size, r1)
            if lo >= hi:
                continue
            src[0] = (p.src_start + lo - p.dst_start, p.src_start + hi - p.dst_start)
            dst[0] = (lo - r0, hi - r0)
        else:
            src[0], dst[0] = (r0, r1), (0, r1 - r0)
            if dim is not None:
                src[dim] = (p.src_start, p.src_stop)
                dst[dim] = (p.dst_start, p.dst_start + p.size)
        out.append(BlockRead(p.src_rank, tuple(src), tuple(dst), tuple(element_ranges(src_local, tuple(src)))))
    return out


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def narrow_box(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``tensor`` a box selects."""
    for d, (lo, hi) in enumerate(box):
        tensor = tensor.narrow(d, lo, hi - lo)
    return tensor
