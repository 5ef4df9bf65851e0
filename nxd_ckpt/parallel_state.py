"""Where the parallel layout comes from: NxD's parallel_state when it is importable and initialised, else ours.

Every coordinate and group is read from the parallel state in force, never recomputed from sizes: with NxD,
its replica-group getters give the rank table and its rank getters are checked against it; without NxD,
``initialize_model_parallel`` builds exactly the groups NxD's would for the same platform and sizes
(``topology.build_nxd_groups``). The only state kept here is those groups, cleared by ``destroy_model_parallel``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from nxd_ckpt.ranks import coordinator as dist
from nxd_ckpt.ranks.topology import LayoutError, RankGroups, Topology, build_nxd_groups, detect_platform

_configured: RankGroups | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
    *,
    platform: str | None = None,
) -> RankGroups | None:
    """Declare this job's parallel sizes (NxD's signature); DP is whatever remains of the world size.

    The groups are NxD's for the same sizes on this platform: row-major ``[PP, DP, CP, TP]`` (expert regions
    ``[PP, EDP, EP, TP]``), trn1's non-contiguous TP=4 groups (per node of LOCAL_WORLD_SIZE ranks) and trn2's
    ring for TP=64 (LNC 1) or TP=32 (LNC 2). ``platform`` ("trn1", "trn2", "generic"; default:
    NXD_CKPT_PLATFORM, else torch_neuronx's answer, else "generic") chooses among them. ``skip_collective_init``
    is accepted for NxD compatibility (nxd_ckpt creates no device collectives here). With ``mesh_only`` the
    groups are returned and nothing is configured.

    Raises:
        ValueError: a size below 1, sizes that do not divide the world size, or a layout NxD cannot build.
    """
    global _configured
    local = os.environ.get("LOCAL_WORLD_SIZE")
    groups = build_nxd_groups(
        _world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        platform=detect_platform(platform),
        lnc_size=int(lnc_size),
        local_world_size=int(local) if local else None,
    )
    if mesh_only:
        return groups
    Topology.from_groups(groups, _rank())  # fail now, not at the first save, if the groups are inconsistent
    _configured = groups
    return None


def destroy_model_parallel() -> None:
    """Forget the groups set by ``initialize_model_parallel`` (the world becomes plain DP again)."""
    global _configured
    _configured = None


def model_parallel_is_initialized() -> bool:
    return _configured is not None


def _world_size() -> int:
    return dist.world_size()


def _rank() -> int:
    return dist.world_rank()


def _nxd_parallel_state() -> ModuleType | None:
    """NxD's parallel_state module if neuronx_distributed is really installed (not PyPI's placeholder)."""
    name = "neuronx_distributed.parallel_layers.parallel_state"
    if name in sys.modules:
        return sys.modules[name]
    try:
        if importlib.util.find_spec("neuronx_distributed") is None:
            return None
        return importlib.import_module(name)
    except Exception:  # the PyPI placeholder raises on import; treat it as absent
        return None


def _local_sizes(rank: int, world: int) -> tuple[int, int]:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(local_world, 1)))
    return local_rank, local_world


# (our kind, NxD's replica-groups getter, NxD's rank getter, NxD's size getter)
_NXD_GETTERS = (
    (
        "tp",
        "get_tensor_model_parallel_replica_groups",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_size",
    ),
    (
        "pp",
        "get_pipeline_model_parallel_replica_groups",
        "get_pipeline_model_parallel_rank",
        "get_pipeline_model_parallel_size",
    ),
    ("dp", "get_data_parallel_replica_groups", "get_data_parallel_rank", "get_data_parallel_size"),
    (
        "cp",
        "get_context_model_parallel_replica_groups",
        "get_context_model_parallel_rank",
        "get_context_model_parallel_size",
    ),
    (
        "ep",
        "get_expert_model_parallel_replica_groups",
        "get_expert_model_parallel_rank",
        "get_expert_model_parallel_size",
    ),
    (
        "edp",
        "get_expert_data_parallel_replica_groups",
        "get_expert_data_parallel_rank",
        "get_expert_data_parallel_size",
    ),
)


def _nxd_topology(nxd: ModuleType, rank: int, world: int, local_rank: int, local_world: int) -> Topology:
    """The rank table from NxD's replica groups, checked against NxD's own rank and size getters."""
    lists: dict[str, list[list[int]]] = {}
    for kind, groups_getter, _, _ in _NXD_GETTERS:
        getter = getattr(nxd, groups_getter, None)
        if getter is not None:
            lists[kind] = [list(g) for g in getter()]
        elif kind in ("cp", "ep"):  # an NxD without context/expert parallelism: every rank alone
            lists[kind] = [[r] for r in range(world)]
        elif kind == "edp":
            lists[kind] = lists["dp"]
        else:
            raise LayoutError(f"NxD's parallel_state has no {groups_getter}(); nxd_ckpt cannot read its groups")
    topo = Topology.from_groups(RankGroups(**lists), rank, local_rank=local_rank, local_world_size=local_world)
    if topo.world_size != world:
        raise LayoutError(f"NxD's groups describe {topo.describe()} but torch.distributed has {world} ranks")
    mine = topo.coordinates()
    for kind, _, rank_getter, size_getter in _NXD_GETTERS:
        if kind in ("ep", "edp") and topo.ep_size == 1:
            continue  # NxD's own expert groups are not used without expert parallelism
        if not hasattr(nxd, rank_getter):
            continue
        got_rank, got_size = int(getattr(nxd, rank_getter)()), int(getattr(nxd, size_getter)())
        want_rank = getattr(mine, kind)
        want_size = len(topo.group_ranks(kind))
        if (got_rank, got_size) != (want_rank, want_size):
            raise LayoutError(
                f"rank {rank}: NxD's {rank_getter}() = {got_rank} (size {got_size}) but its replica groups put this "
                f"rank at {kind.upper()} position {want_rank} of {want_size}; refusing to save or load with an "
                "inconsistent parallel state"
            )
    return topo


def current_topology() -> Topology:
    """The layout of the running job: NxD's if initialised, else nxd_ckpt's own, else DP over the whole world.

    Raises:
        LayoutError: the groups in force are inconsistent (a rank seen twice or missing, sizes that disagree,
            NxD's rank getters disagreeing with its replica groups).
    """
    rank, world = _rank(), _world_size()
    local_rank, local_world = _local_sizes(rank, world)
    nxd = _nxd_parallel_state()
    if nxd is not None and nxd.model_parallel_is_initialized():
        return _nxd_topology(nxd, rank, world, local_rank, local_world)
    if _configured is not None:
        topo = Topology.from_groups(_configured, rank, local_rank=local_rank, local_world_size=local_world)
        if topo.world_size != world:
            raise LayoutError(
                f"initialize_model_parallel was called for a world of {topo.world_size} ranks but torch.distributed "
                f"now has {world}; call destroy_model_parallel() and initialize_model_parallel() again"
            )
        return topo
    return Topology(dp_size=world, rank=rank, local_rank=local_rank, local_world_size=local_world)
