"""``nxd_ckpt.dcp.StorageWriter`` under DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) on 2
spawned gloo ranks: from the second save on, DCP hands every rank the first save's plan again (its
``storage_data`` included), so nothing of one save may ride in it. Several saves in a row, each with other values:
each commits its own folder, loads back bit-exactly and verifies; through the memory tier (durable every 2nd save,
2 simulated nodes), each save's own decision holds on every rank (the folder gets only the durable saves, the
tier every save under its own time)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import StorageReader, StorageWriter, verify

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane

SAVES = 4


def _state(save: int) -> dict[str, torch.Tensor]:
    """Rank-local state of ``save``: the same shapes every save (so the plans are cached), other values."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 * save + rank)
    return {f"rank{rank}.w": torch.randn(64, generator=gen), f"rank{rank}.b": torch.randn(8, generator=gen)}


def _tier(mem: str) -> nxd.MemoryTier:
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"
    return nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=2, max_copies=8)


def _loaded(path: str, save: int, **reader: object) -> None:
    """``path`` loads as ``save``'s state, bit-exactly, on this rank."""
    out = {k: torch.zeros_like(v) for k, v in _state(save).items()}
    dcp.load(out, storage_reader=StorageReader(path, **reader))  # type: ignore[arg-type]
    for key, value in _state(save).items():
        assert torch.equal(out[key], value), (path, key)


def _save_with_cached_plans(base: str, mem: str | None) -> None:
    warnings.simplefilter("ignore")
    tier = _tier(mem) if mem is not None else None
    for save in range(1, SAVES + 1):
        path = os.path.join(base, f"step-{save}")
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(_state(save), storage_writer=StorageWriter(path, memory_tier=tier), planner=planner)
    for save in range(1, SAVES + 1):
        path = os.path.join(base, f"step-{save}")
        durable = tier is None or save % 2 == 0  # every 2nd save through the tier also goes to the folder
        assert os.path.exists(os.path.join(path, ".metadata")) == durable, path
        if durable:
            _loaded(path, save)
            if dist.get_rank() == 0:
                assert verify(path).ok, path
        if tier is not None and save >= SAVES - 1:  # the tier keeps the newest saves: each one complete
            _loaded(path, save, memory_tier=tier)
    assert sorted(n for n in os.listdir(base) if n.startswith(".")) == []  # nothing half-written beside them


def test_each_save_commits_its_own_folder_with_cached_plans(tmp_path):
    run_on_ranks(_save_with_cached_plans, 2, dict(base=str(tmp_path / "ckpt"), mem=None))


def test_each_save_keeps_its_own_memory_tier_decision_with_cached_plans(tmp_path):
    kwargs = dict(base=str(tmp_path / "ckpt"), mem=str(tmp_path / "mem"))
    run_on_ranks(_save_with_cached_plans, 2, kwargs, ranks_per_node=1)
