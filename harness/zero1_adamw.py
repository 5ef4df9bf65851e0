"""A small, real ZeRO-1 AdamW over a gloo DP group, for tests: training really runs sharded.

Each DP rank owns a dim-0 chunk (padded, as in ``nxd_ckpt.load.zero1``) of every parameter: its fp32 master shard and
the Adam moments of that shard live in an inner ``torch.optim.AdamW``. ``step`` all-reduces (averages) the
gradients over the DP group, updates the local shard, and all-gathers the shards back into the full parameters.
``state_dict`` has the layout of torch_xla's ``ZeroRedundancyOptimizer`` (``base_state``, ``shape_info``,
``param_groups``, optional ``sharded_master_weights``), so checkpoints of it are ZeRO-1 checkpoints.
Test code only: it talks to ``torch.distributed`` directly (the library itself does so only in ``dist.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from nxd_ckpt.load import zero1
from nxd_ckpt.optimizers import register_zero1_optimizer

_INNER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


@register_zero1_optimizer
class Zero1AdamW(torch.optim.Optimizer):
    """AdamW whose state is sharded over the DP group (default: the whole world)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        group: Any = None,
        save_master_weights: bool = True,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(group) if distributed else 1
        self.dp_rank = dist.get_rank(group) if distributed else 0
        self.save_master_weights = save_master_weights
        self._init_shards()

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _shards(self) -> list[torch.nn.Parameter]:
        return [s for g in self.base_optimizer.param_groups for s in g["params"]]

    def _init_shards(self) -> None:
        groups = []
        for g in self.param_groups:
            shards = [
                torch.nn.Parameter(zero1.shard_tensor(p.detach().float(), self.dp_size, self.dp_rank))
                for p in g["params"]
            ]
            groups.append({**{k: g[k] for k in _INNER_KEYS if k in g}, "params": shards})
        self.base_optimizer = torch.optim.AdamW(groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for g, inner in zip(self.param_groups, self.base_optimizer.param_groups, strict=True):
            for k in _INNER_KEYS:
                if k in g:
                    inner[k] = g[k]
            for p, shard in zip(g["params"], inner["params"], strict=True):
                grad = p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(shard.data)
                if self.dp_size > 1:
                    dist.all_reduce(grad, group=self.group)
                    grad /= self.dp_size
                shard.grad = zero1.shard_tensor(grad, self.dp_size, self.dp_rank)
        self.base_optimizer.step()
        self._gather_params()
        return loss

    def _gather_params(self) -> None:
        for p, shard in zip(self._params(), self._shards(), strict=True):
            if self.dp_size > 1:
                parts = [torch.empty_like(shard.data) for _ in range(self.dp_size)]
                dist.all_gather(parts, shard.data.contiguous(), group=self.group)
                full = torch.cat(parts)
            else:
                full = shard.data
            p.data.copy_(full[: p.shape[0]].to(p.dtype))

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        sd = super().state_dict()
        sd["base_state"] = self.base_optimizer.state_dict()["state"]
        sd["shape_info"] = {i: p.shape for i, p in enumerate(self._params())}
        if self.save_master_weights:
            sd["sharded_master_weights"] = {i: s.data for i, s in enumerate(self._shards())}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        sd = dict(state_dict)
        base_state = sd.pop("base_state")
        shape_info = sd.pop("shape_info")
        master = sd.pop("sharded_master_weights", None)
        for i, p in enumerate(self._params()):
            if tuple(shape_info[i]) != tuple(p.shape):
                raise ValueError(f"parameter {i}: saved shape {tuple(shape_info[i])}, model {tuple(p.shape)}")
        super().load_state_dict(sd)
        self._init_shards()
        inner = self.base_optimizer.state_dict()
        inner["state"] = base_state
        inner["param_groups"] = [
            {**{k: g[k] for k in g if k in _INNER_KEYS}, "params": ig["params"]}
            for g, ig in zip(sd["param_groups"], inner["param_groups"], strict=True)
        ]
        self.base_optimizer.load_state_dict(inner)
        if master is not None:
            with torch.no_grad():
                for i, s in enumerate(self._shards()):
                    s.data.copy_(master[i])
                self._gather_params()
