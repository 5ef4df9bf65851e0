"""Where the parallel layout comes from: NxD's parallel_state when it is importable and initialised, else ours.

``initialize_model_parallel`` mirrors NxD's call for programs that do not use NeuronX Distributed. The only
state kept here is the configured sizes, cleared by ``destroy_model_parallel``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

from . import dist
from .topology import Topology


@dataclass(frozen=True)
class _ModelParallelSizes:
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int


_configured: _ModelParallelSizes | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Declare the TP and PP sizes of this job; DP is whatever remains of the world size.

    Raises:
        ValueError: a size below 1, or a world size that TP * PP does not divide.
    """
    global _configured
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor and pipeline model parallel sizes must be >= 1, got TP={tp} PP={pp}")
    world = _world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP*PP = {tp}*{pp}; choose sizes whose product divides it"
        )
    _configured = _ModelParallelSizes(tp, pp)


def destroy_model_parallel() -> None:
    """Forget the sizes set by ``initialize_model_parallel`` (the world becomes TP=PP=1 again)."""
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


def current_topology() -> Topology:
    """The layout of the running job: NxD's if initialised, else nxd_ckpt's own, else DP over the whole world."""
    rank, world = _rank(), _world_size()
    local_rank, local_world = _local_sizes(rank, world)
    nxd = _nxd_parallel_state()
    if nxd is not None and nxd.model_parallel_is_initialized():
        tp = nxd.get_tensor_model_parallel_size()
        pp = nxd.get_pipeline_model_parallel_size()
    elif _configured is not None:
        tp, pp = _configured.tensor_model_parallel_size, _configured.pipeline_model_parallel_size
    else:
        tp, pp = 1, 1
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by TP*PP = {tp}*{pp}")
    return Topology(
        tp_size=tp,
        pp_size=pp,
        dp_size=world // (tp * pp),
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
    )
