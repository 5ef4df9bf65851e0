"""Tensor-parallel layers for tests, marked exactly as NxD's ``ColumnParallelLinear`` / ``RowParallelLinear``
mark theirs, that really train sharded over a gloo TP group.

Each layer holds its TP rank's shard of a weight initialised whole from a seed and cut as NxD's
``create_local_weight`` cuts it (``partition_stride`` chunks dealt round-robin to the ranks), and carries NxD's
attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``num_partitions``,
``rank_ordering``), set as ``set_tensor_model_parallel_attributes`` sets them. The forward pass all-gathers the
shards into the whole weight and its backward keeps this rank's part of the (identical on every TP rank)
gradient, so a model at TP=N computes exactly what the same model at TP=1 computes. The model's first TP
replicas of each PP stage build the same global weights whatever the layout, which is what the re-sharding tests
compare against. Test code only: it talks to ``torch.distributed`` directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def nxd_local_weight(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """NxD's ``create_local_weight``: split into per-stride chunks, deal them to ranks, concatenate."""
    per_partition = full.shape[dim] // tp
    chunks = torch.split(full, per_partition // stride, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim).contiguous()


def nxd_full_weight(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The inverse of ``nxd_local_weight`` over all ranks' shards (NxD's checkpoint converter's merge)."""
    tp = len(shards)
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def set_nxd_attributes(tensor: torch.Tensor, dim: int, stride: int, num_partitions: int) -> None:
    """What NxD's ``set_tensor_model_parallel_attributes`` sets on a parallel parameter."""
    tensor.tensor_model_parallel = True  # type: ignore[attr-defined]
    tensor.partition_dim = dim  # type: ignore[attr-defined]
    tensor.partition_stride = stride  # type: ignore[attr-defined]
    tensor.num_partitions = num_partitions  # type: ignore[attr-defined]
    tensor.rank_ordering = None  # type: ignore[attr-defined]


class _Gather(torch.autograd.Function):
    """Forward: the whole tensor from the TP shards. Backward: this rank's part of the whole gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:  # type: ignore[override]
        tp = dist.get_world_size(group)
        ctx.dim, ctx.stride, ctx.tp, ctx.rank = dim, stride, tp, dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return nxd_full_weight(parts, dim, stride)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return nxd_local_weight(grad, ctx.dim, ctx.tp, ctx.rank, ctx.stride), None, None, None


class ParallelLinear(nn.Module):
    """A linear layer whose weight (and bias, for column parallel) is sharded over the TP group like NxD's.

    ``partition_dim`` 0 is ``ColumnParallelLinear`` (output features; bias sharded too, with the same stride),
    1 is ``RowParallelLinear`` (input features; bias replicated).
    """

    def __init__(
        self, d_in: int, d_out: int, partition_dim: int, *, stride: int = 1, seed: int, tp_group: Any = None
    ) -> None:
        super().__init__()
        distributed = dist.is_available() and dist.is_initialized() and tp_group is not None
        self.tp = dist.get_world_size(tp_group) if distributed else 1
        self.rank = dist.get_rank(tp_group) if distributed else 0
        self.group, self.dim, self.stride = tp_group, partition_dim, stride
        g = torch.Generator().manual_seed(seed)
        full_w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
        full_b = torch.randn(d_out, generator=g) * 0.1
        self.weight = nn.Parameter(nxd_local_weight(full_w, partition_dim, self.tp, self.rank, stride))
        set_nxd_attributes(self.weight, partition_dim, stride, self.tp)
        if partition_dim == 0:
            self.bias = nn.Parameter(nxd_local_weight(full_b, 0, self.tp, self.rank, stride))
            set_nxd_attributes(self.bias, 0, stride, self.tp)
        else:
            self.bias = nn.Parameter(full_b)

    def full(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return t
        return _Gather.apply(t, dim, self.stride, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.full(self.bias, 0) if self.dim == 0 else self.bias
        return nn.functional.linear(x, self.full(self.weight, self.dim), bias)


class Block(nn.Module):
    """LayerNorm (replicated), a fused gate/up column-parallel projection (stride 2) and a row-parallel one."""

    def __init__(self, d: int, hidden: int, seed: int, tp_group: Any = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
        self.gate_up = ParallelLinear(d, 2 * hidden, 0, stride=2, seed=seed + 1, tp_group=tp_group)
        self.down = ParallelLinear(hidden, d, 1, seed=seed + 2, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TPModel(nn.Module):
    """``layers.<i>`` blocks; with pipeline parallelism a stage holds only its own blocks (NxD keeps the
    original names), ``layers_per_stage`` each."""

    def __init__(
        self,
        d: int = 8,
        hidden: int = 8,
        n_layers: int = 2,
        *,
        tp_group: Any = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        per_stage = n_layers // pp_size
        self.layers = nn.ModuleDict(
            {
                str(i): Block(d, hidden, seed=seed + 10 * i, tp_group=tp_group)
                for i in range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def full_state(model_cls_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The unsharded reference: the same model built at TP=1, PP=1 (no process group)."""
    return {k: v.clone() for k, v in TPModel(**model_cls_kwargs).state_dict().items()}
