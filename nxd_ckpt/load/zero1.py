"""ZeRO-1 optimizer-state sharding as pure tensor arithmetic (no I/O): merge, re-shard, and slice plans.

The layout is torch_xla's ``ZeroRedundancyOptimizer`` (and NxD's ``NeuronZero1Optimizer``): a parameter of full
shape ``[R, ...]`` is padded with zero rows along dim 0 to a multiple of DP and split into DP equal chunks; DP
rank ``d`` holds chunk ``d``. A state dict holds ``base_state`` ({param index: {"step": scalar, "exp_avg":
shard, ...}}), ``shape_info`` ({param index: full shape}), ``param_groups`` and optionally
``sharded_master_weights`` ({param index: shard}).

Which tensors are shards: every tensor of at least one dimension in ``base_state[i]`` (nested dicts included)
and every ``sharded_master_weights[i]``; 0-d tensors (``step``) and everything else are the same on all ranks
and copied from DP rank 0. A "full" state is the same dict with every shard replaced by the whole, unpadded
tensor (what NxD's converter writes to ``optim/full_tp_rank_XX_pp_rank_YY.pt``); it is the DP=1 case of the
arithmetic below (one chunk of R rows, no padding).

A slice plan says which rows of which source shards make up one target shard, so a converter or a loader can
copy rows straight from (memory-mapped or per-tensor) source files into the target without ever building the
merged state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import FormatError

BASE_STATE = "base_state"
SHAPE_INFO = "shape_info"
MASTER_WEIGHTS = "sharded_master_weights"

EntryPath = tuple[Any, ...]
"""Where a shard tensor sits in a ZeRO-1 state dict, e.g. ``("base_state", 3, "exp_avg")``."""


# --------------------------------------------------------------------------------------------- row arithmetic


def chunk_rows(rows: int, dp: int) -> int:
    """Rows in each DP chunk of a tensor with ``rows`` rows: ``ceil(rows / dp)`` (dp=1: all rows)."""
    if dp < 1:
        raise ValueError(f"DP size must be >= 1, got {dp}")
    return -(-rows // dp)


def shard_rows(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """The [start, stop) rows of the full tensor that DP rank ``rank`` holds, clipped to real rows (excludes
    padding); ``start == stop`` for a chunk that is all padding."""
    if not 0 <= rank < dp:
        raise ValueError(f"DP rank {rank} is outside DP size {dp}")
    c = chunk_rows(rows, dp)
    return min(rank * c, rows), min((rank + 1) * c, rows)


@dataclass(frozen=True)
class Piece:
    """Rows ``[src_start, src_stop)`` of source shard ``src_rank`` go to rows starting at ``dst_start`` of the
    target shard (row numbers local to each shard)."""

    src_rank: int
    src_start: int
    src_stop: int
    dst_start: int

    @property
    def rows(self) -> int:
        return self.src_stop - self.src_start


def slice_plan(rows: int, src_dp: int, dst_dp: int, dst_rank: int) -> list[Piece]:
    """Which parts of the ``src_dp`` source shards the target shard ``dst_rank`` of ``dst_dp`` covers.

    Only real rows are listed: target rows past the parameter's ``rows`` are padding (zeros). Pass DP=1 for a
    full (unsharded) tensor on either side.
    """
    start, stop = shard_rows(rows, dst_dp, dst_rank)
    dst_base = dst_rank * chunk_rows(rows, dst_dp)
    c_src = chunk_rows(rows, src_dp)
    pieces = []
    row = start
    while row < stop:
        src = row // c_src
        src_stop = min(stop, (src + 1) * c_src)
        pieces.append(Piece(src, row - src * c_src, src_stop - src * c_src, row - dst_base))
        row = src_stop
    return pieces


def shard_shape(full_shape: Sequence[int], dp: int) -> tuple[int, ...]:
    """Shape of each DP chunk of a tensor of ``full_shape`` (the full shape itself for dp=1)."""
    return (chunk_rows(int(full_shape[0]), dp), *(int(d) for d in full_shape[1:]))


# --------------------------------------------------------------------------------------------- tensors


def shard_tensor(full: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """DP rank ``rank``'s chunk of ``full``: pad dim 0 with zeros to a multiple of ``dp``, chunk, take one."""
    out = full.new_zeros(shard_shape(full.shape, dp))
    start, stop = shard_rows(full.shape[0], dp, rank)
    out[: stop - start].copy_(full[start:stop])
    return out


def merge_shards(shards: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """Concatenate the DP chunks in DP order and cut the padding off, back to ``rows`` rows."""
    return torch.cat(list(shards))[:rows].clone()


def assemble(
    pieces: Sequence[Piece], sources: Sequence[torch.Tensor] | dict[int, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Fill ``out`` (a target shard) from source shards by a slice plan; rows no piece covers become zeros."""
    covered = 0
    for p in pieces:
        out[p.dst_start : p.dst_start + p.rows].copy_(sources[p.src_rank][p.src_start : p.src_stop])
        covered = max(covered, p.dst_start + p.rows)
    if covered < out.shape[0]:
        out[covered:].zero_()
    return out


# --------------------------------------------------------------------------------------------- state dicts


def is_zero1_state(state: Any) -> bool:
    """Whether ``state`` looks like a ZeRO-1 optimizer state dict (``base_state`` and ``shape_info``)."""
    return (
        isinstance(state, dict) and isinstance(state.get(BASE_STATE), dict) and isinstance(state.get(SHAPE_INFO), dict)
    )


def full_shapes(state: dict, what: str = "the optimizer state") -> dict[Any, tuple[int, ...]]:
    """``shape_info`` as plain tuples, checked to be shapes of at least one dimension."""
    if not is_zero1_state(state):
        raise FormatError(
            f"{what} is not a ZeRO-1 optimizer state: it has no 'base_state'/'shape_info' "
            f"(keys: {sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__})"
        )
    shapes = {}
    for index, shape in state[SHAPE_INFO].items():
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise FormatError(f"{what}: shape_info[{index!r}] is a 0-d shape; ZeRO-1 shards along dim 0")
        shapes[index] = shape
    return shapes


def iter_shard_entries(state: dict) -> Iterator[tuple[EntryPath, Any, Any]]:
    """(path, param index, value) of every sharded tensor slot: ``base_state[i]...`` tensors of >= 1
    dimension and ``sharded_master_weights[i]``. Values may be tensors or stand-ins (e.g. xser references)
    whose shard-ness is decided by ``is_shard``."""

    def walk(obj: Any, path: EntryPath, index: Any) -> Iterator[tuple[EntryPath, Any, Any]]:
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(v, (*path, k), index)
        elif not isinstance(obj, (str, bytes, int, float, bool)) and obj is not None:
            yield path, index, obj

    for index, per_param in state[BASE_STATE].items():
        yield from walk(per_param, (BASE_STATE, index), index)
    for index, value in (state.get(MASTER_WEIGHTS) or {}).items():
        yield (MASTER_WEIGHTS, index), index, value


def get_path(state: Any, path: EntryPath) -> Any:
    for k in path:
        state = state[k]
    return state


def set_path(state: Any, path: EntryPath, value: Any) -> None:
    for k in path[:-1]:
        state = state[k]
    state[path[-1]] = value


def sharded_paths(state: dict) -> dict[EntryPath, Any]:
    """{path: param index} of every sharded tensor of a state whose tensors are real (>= 1-d ones)."""
    return {
        path: index
        for path, index, value in iter_shard_entries(state)
        if isinstance(value, torch.Tensor) and is_shard_slot(path, value.dim())
    }


def is_shard_slot(path: EntryPath, ndim: int) -> bool:
    """Whether a tensor of ``ndim`` dimensions at ``path`` is a shard (``step`` never is, as in NxD's tool)."""
    return ndim >= 1 and path[-1] != "step"


def check_shard(state: dict, dp: int, what: str) -> None:
    """Raise FormatError if a shard's shape disagrees with ``shape_info`` for DP size ``dp`` (dp=1: full)."""
    shapes = full_shapes(state, what)
    for path, index in sharded_paths(state).items():
        check_shard_shape(what, path, index, tuple(get_path(state, path).shape), shapes, dp)


def check_shard_shape(
    what: str, path: EntryPath, index: Any, got: tuple[int, ...], shapes: dict[Any, tuple[int, ...]], dp: int
) -> None:
    """Raise FormatError unless the shard at ``path`` of parameter ``index`` has the shape ``shape_info``
    (``shapes``) gives it at DP size ``dp`` (dp=1: full); the one check of a shard, in memory or in a file."""
    if index not in shapes:
        raise FormatError(f"{what}: {_fmt(path)} belongs to parameter {index!r}, which shape_info does not list")
    expected = shard_shape(shapes[index], dp)
    if got != expected:
        kind = "full tensor" if dp == 1 else f"shard for DP={dp}"
        raise FormatError(
            f"{what}: {_fmt(path)} has shape {got}, but shape_info says {shapes[index]}, so a {kind} must "
            f"have shape {expected}; the file does not belong to this checkpoint's DP size or is damaged"
        )


def _fmt(path: EntryPath) -> str:
    """``path`` as the subscripts that reach it in the state, e.g. ``['base_state'][3]['exp_avg']``."""
    return "".join(f"[{k!r}]" for k in path)


def merge_states(states: Sequence[dict], what: str = "ZeRO-1 shards") -> dict:
    """The full state of one (TP, PP) coordinate from its DP shards (in DP order), all in memory."""
    return reshard_states(states, 1, what)[0]


def shard_state(full: dict, dp: int, rank: int, what: str = "the full ZeRO-1 state") -> dict:
    """DP rank ``rank``'s shard (for DP size ``dp``) of a full state."""
    return reshard_rank([full], dp, rank, what)


def reshard_states(states: Sequence[dict], new_dp: int, what: str = "ZeRO-1 shards") -> list[dict]:
    """All ``new_dp`` shards from the source shards (``len(states)`` of them; one full state is DP=1)."""
    return [reshard_rank(states, new_dp, r, what) for r in range(new_dp)]


def reshard_rank(states: Sequence[dict], new_dp: int, new_rank: int, what: str = "ZeRO-1 shards") -> dict:
    """Target shard ``new_rank`` of ``new_dp`` built from the source shards (DP order), in memory."""
    src_dp = len(states)
    if src_dp < 1:
        raise ValueError("reshard needs at least one source state")
    for d, s in enumerate(states):
        check_shard(s, src_dp, f"{what} (DP rank {d} of {src_dp})")
    shapes = full_shapes(states[0], what)
    out = copy.deepcopy(_without_shards(states[0]))
    for path, index in sharded_paths(states[0]).items():
        rows = shapes[index][0]
        src = get_path(states[0], path)
        target = torch.empty(shard_shape(shapes[index], new_dp), dtype=src.dtype)
        sources = [get_path(s, path) for s in states]
        set_path(out, path, assemble(slice_plan(rows, src_dp, new_dp, new_rank), sources, target))
    return out


def _without_shards(state: dict) -> dict:
    """A shallow-structured copy of ``state`` with shard tensors replaced by None (for cheap deep copies)."""
    out = dict(state)
    out[BASE_STATE] = {i: _strip(v, None) for i, v in state[BASE_STATE].items()}
    if MASTER_WEIGHTS in state and state[MASTER_WEIGHTS] is not None:
        out[MASTER_WEIGHTS] = dict.fromkeys(state[MASTER_WEIGHTS])
    return out


def _strip(obj: Any, key: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v, k) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor) and is_shard_slot((key,), obj.dim()):
        return None
    return obj
