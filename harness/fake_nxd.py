"""A stand-in for NxD's ``parallel_state`` module, installed in ``sys.modules``, for tests without NxD.

It is deliberately independent of nxd_ckpt's own group builder: the caller passes the group member lists
literally (written out from NxD's documented layouts), and the getters answer as NxD's do: a rank in a TP, CP,
EP or expert-DP group is its rank in a torch process group over those members (sorted order); DP and PP ranks
are list positions under trn2's ring layout (``list_indexed_dp_pp=True``), as NxD's getters search the lists
there.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence

import torch.distributed as dist

MODULE = "neuronx_distributed.parallel_layers.parallel_state"


def _group_of(groups: Sequence[Sequence[int]], rank: int) -> list[int]:
    for g in groups:
        if rank in g:
            return list(g)
    raise RuntimeError(f"rank {rank} is in none of {groups}")


def install(
    *,
    tp: Sequence[Sequence[int]],
    dp: Sequence[Sequence[int]],
    pp: Sequence[Sequence[int]] | None = None,
    cp: Sequence[Sequence[int]] | None = None,
    ep: Sequence[Sequence[int]] | None = None,
    edp: Sequence[Sequence[int]] | None = None,
    list_indexed_dp_pp: bool = False,
) -> types.ModuleType:
    """Install a fake ``neuronx_distributed.parallel_layers.parallel_state`` with these replica groups."""
    world = dist.get_world_size() if dist.is_initialized() else sum(len(g) for g in tp)
    singles = [[r] for r in range(world)]
    lists = {
        "tp": [list(g) for g in tp],
        "dp": [list(g) for g in dp],
        "pp": [list(g) for g in (pp or singles)],
        "cp": [list(g) for g in (cp or singles)],
        "ep": [list(g) for g in (ep or singles)],
        "edp": [list(g) for g in (edp or dp)],
    }
    mod = types.ModuleType(MODULE)

    def me() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def rank_in(kind: str) -> int:
        group = _group_of(lists[kind], me())
        if list_indexed_dp_pp and kind in ("dp", "pp"):
            return group.index(me())
        return sorted(group).index(me())

    def size_of(kind: str) -> int:
        return len(_group_of(lists[kind], me()))

    names = {
        "tp": "tensor_model_parallel",
        "dp": "data_parallel",
        "pp": "pipeline_model_parallel",
        "cp": "context_model_parallel",
        "ep": "expert_model_parallel",
        "edp": "expert_data_parallel",
    }
    for kind, name in names.items():
        setattr(mod, f"get_{name}_replica_groups", lambda k=kind: [list(g) for g in lists[k]])
        setattr(mod, f"get_{name}_rank", lambda k=kind: rank_in(k))
        setattr(mod, f"get_{name}_size", lambda k=kind: size_of(k))
    mod.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    mod.FAKE_GROUPS = lists  # type: ignore[attr-defined]
    for parent in ("neuronx_distributed", "neuronx_distributed.parallel_layers"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    sys.modules[MODULE] = mod
    return mod


def uninstall() -> None:
    for name in (MODULE, "neuronx_distributed.parallel_layers", "neuronx_distributed"):
        sys.modules.pop(name, None)
