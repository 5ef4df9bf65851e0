"""Sharding records read off NxD's marks on a live model's parameters, or off a user's name patterns (a spec);
a save's record, shared by each stage's first rank and merged on rank 0 (``share_for_save``, ``merge_shares``)."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

from nxd_ckpt.errors import ReshardError
from nxd_ckpt.format.sharding import ShardingRecord, TensorSharding
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.optimizers import unwrap_optimizer

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # loaded on first use, like format/sharding.py's

logger = logging.getLogger("nxd_ckpt")

KV_MODULE_PARAMS = ("weight_k", "weight_v", "bias_k", "bias_v", "weight_qkv", "bias_qkv")
"""Parameters of NxD's ``GQAQKVColumnParallelLinear`` that hold K/V heads (replicated when kv_size_multiplier > 1)."""


def _attr_sharding(param: torch.Tensor, tp: int | None) -> TensorSharding:
    """One parameter's sharding from NxD's attributes (local shape -> global shape at TP ``tp``; None: at the
    parameter's own ``num_partitions``)."""
    local = tuple(int(d) for d in param.shape)
    if not getattr(param, "tensor_model_parallel", False):
        return TensorSharding(local)
    dim = int(getattr(param, "partition_dim", -1))
    stride = int(getattr(param, "partition_stride", 1) or 1)
    parts = int(getattr(param, "num_partitions", tp or 1) or tp or 1)
    tp = parts if tp is None else tp
    ordering = getattr(param, "rank_ordering", None)
    ordering = tuple(int(r) for r in ordering) if ordering is not None else None
    if dim < 0:
        dim += len(local)
    if not 0 <= dim < len(local):
        return TensorSharding(local, unsupported=f"its partition_dim {getattr(param, 'partition_dim', None)} "
                              f"is outside its {len(local)}-d shape")  # fmt: skip
    unsupported = None
    if parts != tp:
        unsupported = f"it is partitioned over {parts} ranks, not over the TP group of {tp}"
    shape = list(local)
    shape[dim] *= tp
    return TensorSharding(tuple(shape), dim, stride, tp, rank_ordering=ordering, unsupported=unsupported)


def _module_overrides(model: torch.nn.Module, tp: int | None) -> dict[str, TensorSharding | str]:
    """Parameters NxD's GQA QKV layer shards in ways its attributes do not say: K/V heads replicated over TP
    ranks (``kv_size_multiplier`` > 1), and the fused ``weight_qkv``, whose attributes sit on views only."""
    out: dict[str, TensorSharding | str] = {}
    for mod_name, module in model.named_modules():
        multiplier = getattr(module, "kv_size_multiplier", None)
        if multiplier is None:
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for pname in KV_MODULE_PARAMS:
            param = getattr(module, pname, None)
            if not isinstance(param, torch.Tensor):
                continue
            if int(multiplier) > 1:
                out[prefix + pname] = (
                    f"its K/V heads are replicated across TP ranks (kv_size_multiplier={int(multiplier)}), so its "
                    "shards are not disjoint parts of one tensor"
                )
            elif pname in ("weight_qkv", "bias_qkv"):
                sizes = getattr(module, "output_sizes", None)
                if sizes and len(sizes) >= 2 and int(sizes[0]) == int(sizes[1]):
                    local = tuple(int(d) for d in param.shape)
                    parts = tp or int(getattr(param, "num_partitions", 1) or 1)
                    out[prefix + pname] = TensorSharding((local[0] * parts, *local[1:]), 0, 3, parts)
                else:
                    out[prefix + pname] = (
                        f"it fuses Q ({sizes[0] if sizes else '?'}) and K/V ({sizes[1] if sizes else '?'}) outputs "
                        "of different sizes, each sharded on its own (not one strided layout)"
                    )
    return out


def record_from_model(
    model: Any,
    tp: int | None,
    pp_stage: int | None = None,
    optimizer: Any = None,
    names: Iterable[str] | None = None,
) -> ShardingRecord:
    """The sharding of a model's state from its parameters' NxD attributes (unmarked tensors: replicated).

    ``tp`` is the TP size the model is built for (None: each parameter's own ``num_partitions``, for a model
    used only to describe a layout). ``names`` limits the record to those state-dict keys (default: parameters
    and buffers). With ``optimizer``, also records which parameter each of its state indices belongs to.
    """
    if not isinstance(model, torch.nn.Module):
        return ShardingRecord()
    overrides = _module_overrides(model, tp)
    wanted = set(names) if names is not None else None
    tensors: dict[str, TensorSharding] = {}
    by_id: dict[int, str] = {}
    entries = list(model.named_parameters(remove_duplicate=False))
    entries += list(model.named_buffers(remove_duplicate=False))
    for name, tensor in entries:
        by_id.setdefault(id(tensor), name)
        if wanted is not None and name not in wanted:
            continue
        override = overrides.get(name)
        if isinstance(override, TensorSharding):
            s = override
        else:
            s = _attr_sharding(tensor, tp)
            if isinstance(override, str):
                s = replace(s, unsupported=override)
        tensors[name] = s.with_stage(pp_stage)
    orders: dict[int, tuple[str | None, ...]] = {}
    if optimizer is not None:
        inner = unwrap_optimizer(optimizer)
        groups = getattr(inner, "param_groups", None)
        if groups:
            order = tuple(by_id.get(id(p)) for g in groups for p in g.get("params", []))
            orders[pp_stage or 0] = order
    return ShardingRecord(tensors, orders)


SpecValue = int | tuple[int, int] | None
"""A user's sharding for a name pattern: a partition dim, ``(dim, stride)``, or None for replicated."""


def record_from_spec(
    spec: Mapping[str, SpecValue],
    local_shapes: Mapping[str, Sequence[int]],
    tp: int,
    pp_stage: int | None = None,
) -> ShardingRecord:
    """The sharding of tensors saved at TP=``tp`` (their per-rank shapes given) from name patterns.

    Patterns are ``fnmatch`` globs tried in order (the first match wins). At TP > 1 a tensor no pattern matches
    raises ReshardError naming it (add ``'*': None`` to call everything else replicated).
    """
    tensors = {}
    for name, local in local_shapes.items():
        value: Any = _NO_MATCH
        for pattern, v in spec.items():
            if fnmatch.fnmatchcase(name, pattern):
                value = v
                break
        local = tuple(int(d) for d in local)
        if value is _NO_MATCH:
            if tp > 1:
                raise ReshardError(
                    f"the sharding spec has no pattern matching tensor {name!r} (saved at TP={tp}); add one "
                    "(its partition dim, (dim, stride), or None if replicated), or '*': None for the rest"
                )
            value = None
        if value is None:
            tensors[name] = TensorSharding(local, pp_stage=pp_stage)
            continue
        dim, stride = (value, 1) if isinstance(value, int) else (int(value[0]), int(value[1]))
        if dim < 0:
            dim += len(local)
        if not 0 <= dim < len(local):
            raise ReshardError(
                f"the sharding spec gives tensor {name!r} partition dim {value!r}, but it is {len(local)}-d"
            )
        shape = list(local)
        shape[dim] *= tp
        tensors[name] = TensorSharding(tuple(shape), dim, stride, tp, pp_stage)
    return ShardingRecord(tensors)


_NO_MATCH = object()


def rebase(sharding: TensorSharding, local_shape: Sequence[int], tp: int) -> TensorSharding:
    """``sharding`` (e.g. from a target model at another TP) re-expressed for shards of ``local_shape`` at TP
    ``tp``: the global shape comes from the local one."""
    local = tuple(int(d) for d in local_shape)
    if sharding.partition_dim is None:
        return replace(sharding, shape=local, num_partitions=1)
    shape = list(local)
    shape[sharding.partition_dim] *= tp
    return replace(sharding, shape=tuple(shape), num_partitions=tp)


def record_for_save(model: Any, state: Any, optimizer: Any, tp: int, pp_stage: int) -> ShardingRecord:
    """What a save records for one PP stage: the sharding of each tensor of the model's saved ``state`` (from
    its parameters' NxD attributes; a plain dict's tensors only at TP = 1, where they are whole) and the
    optimizer's parameter order. Tensors it cannot describe are left out (a load at another layout then asks
    for a sharding spec naming them)."""
    names = [k for k, v in state.items() if isinstance(v, torch.Tensor)] if isinstance(state, Mapping) else []
    if isinstance(model, torch.nn.Module):
        return record_from_model(model, tp, pp_stage, optimizer, names)
    if tp == 1:
        return ShardingRecord({n: TensorSharding(tuple(state[n].shape), pp_stage=pp_stage) for n in names})
    return ShardingRecord()


# --------------------------------------------------------------------------------------------- a save's record
ShardingShare: TypeAlias = "ShardingRecord | str | None"
"""What one rank contributes to a save's sharding record: its stage's record, the error that kept it from one (as
text), or None (ranks other than each stage's first replica of TP rank 0)."""


def share_for_save(
    model: Any, state: Any, optimizer: Any, *, rank: int, tp_rank: int, replica_rank: int, tp: int, pp_stage: int
) -> ShardingShare:
    """This rank's share of a save's sharding record: each stage's first replica of TP rank 0 describes its stage
    (``record_for_save``). Never raises: a save must not fail (or leave the others waiting) over the record."""
    if tp_rank != 0 or replica_rank != 0:
        return None
    try:
        return record_for_save(model, state, optimizer, tp, pp_stage)
    except Exception as e:
        return f"rank {rank}: {e}"


def merge_shares(shares: Iterable[ShardingShare]) -> ShardingRecord | None:
    """Rank 0: how every model tensor of every PP stage is sharded, from every rank's share. None, with a
    warning, when it cannot be recorded (the checkpoint is then still saved, only not re-shardable without a
    sharding spec)."""
    shares = list(shares)
    problems = [g for g in shares if isinstance(g, str)]
    try:
        if problems:
            raise ValueError("; ".join(problems))
        merged = ShardingRecord.merge(g for g in shares if isinstance(g, ShardingRecord))
        return merged if merged.tensors else None  # e.g. a dict at TP > 1: nothing known, nothing recorded
    except Exception as e:
        logger.warning(
            "the sharding of the model could not be recorded (%s): loads at another layout will need sharding=", e
        )
        return None
