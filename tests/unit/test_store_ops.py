"""Store operations per rank per save are bounded by a constant: they do not grow with how long a rank waits for
a late one (blocking waits on a connection of its own, not polls), nor with the number of ranks."""

from __future__ import annotations

import time

import pytest
import torch

from nxd_ckpt.dist.topology import Topology
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.threadworld import ThreadWorld

LATE_RANK = 3


def _save_ops(tmp_path, world: ThreadWorld, managers: list, tag: str, late_s: float, async_save: bool) -> list[int]:
    """Store operations each rank made during one save (``LATE_RANK`` starts it ``late_s`` late)."""
    before = [t.total() for t in world.tallies]

    def save(rank: int) -> None:
        if rank == LATE_RANK:
            time.sleep(late_s)
        managers[rank].save(tmp_path, tag, model={"w": torch.ones(4) * rank}, async_save=async_save)
        managers[rank].finalize()

    world.run(save)
    return [t.total() - b for t, b in zip(world.tallies, before, strict=True)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_store_ops_per_rank_do_not_grow_with_the_wait(tmp_path, async_save):
    world = ThreadWorld(4, count=True)
    managers = [
        CheckpointManager(coordinator=world.coordinator(r), topology=Topology(rank=r, tp_size=4)) for r in range(4)
    ]
    _save_ops(tmp_path, world, managers, "warm", 0.0, async_save)  # sessions, first keys
    short = _save_ops(tmp_path, world, managers, "s1", 0.2, async_save)
    long = _save_ops(tmp_path, world, managers, "s2", 2.5, async_save)
    # equal but for who arrives last at a step (that rank sets the key the others wait for: one operation)
    assert all(abs(a - b) <= 2 for a, b in zip(long, short, strict=True)), (
        f"per rank: {short} at 0.2 s late, {long} at 2.5 s"
    )
    assert max(long) <= 40, long  # a handful per step (polling every 10 ms made ~250 per waiting rank here)
    waits = [t.snapshot().get(("waiting", "wait"), 0) for t in world.tallies]
    assert all(n > 0 for n in waits)  # the waits are blocking waits on the rank's own connection


def test_store_ops_per_rank_do_not_grow_with_the_ranks(tmp_path):
    def per_rank(n: int) -> list[int]:
        world = ThreadWorld(n, count=True)
        managers = [
            CheckpointManager(coordinator=world.coordinator(r), topology=Topology(rank=r, tp_size=n)) for r in range(n)
        ]
        _save_ops(tmp_path / str(n), world, managers, "warm", 0.0, False)
        return _save_ops(tmp_path / str(n), world, managers, "s1", 0.0, False)

    small, large = per_rank(2), per_rank(16)
    assert max(large) <= max(small) + 2, (small, large)
