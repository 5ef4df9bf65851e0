"""Retention, failure propagation and the num_workers bound, on real spawned gloo ranks."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.testing.fakes import TinyMLP, make_training


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("user content cannot be pickled")


@run_with_ranks(2)
def test_retention_latest_and_failed_save(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model, opt, _ = make_training(seed=0)
    for step in range(1, 5):
        nxd.save_checkpoint(ckpt, f"step_{step}", model=model, optimizer=opt, num_kept_ckpts=2)
    assert _listed_after_retention(ckpt) == ["step_3", "step_4"]
    # A save that fails on the master only: every rank raises the same type, no 'done', the previous latest stays.
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="cannot be pickled") as raised:
            nxd.save_checkpoint(ckpt, "step_5", model=model, user_content=_Unpicklable(), num_kept_ckpts=2)
    else:
        with pytest.raises(RuntimeError, match="rank 0.*cannot be pickled") as raised:
            nxd.save_checkpoint(ckpt, "step_5", model=model, user_content=None, num_kept_ckpts=2)
    assert type(raised.value) is RuntimeError and raised.value.origin_rank == 0
    assert not os.path.exists(os.path.join(ckpt, "step_5", "done"))
    assert nxd.latest_checkpoint_tag(ckpt) == "step_4"
    nxd.load_checkpoint(ckpt, model=TinyMLP())
    # The job goes on: the next save works and retention still keeps two complete tags.
    nxd.save_checkpoint(ckpt, "step_6", model=model, num_kept_ckpts=2)
    assert _listed_after_retention(ckpt) == ["step_4", "step_6"]


def _listed_after_retention(ckpt: str) -> list[str]:
    """Retention deletes on rank 0's writer thread after the save returns: rank 0's listing waits for it;
    other ranks list once rank 0 has."""
    if dist.get_rank() == 0:
        nxd.list_checkpoint_tags(ckpt)
    dist.barrier()
    return nxd.list_checkpoint_tags(ckpt)


@run_with_ranks(4)
def test_num_workers_bounds_concurrent_ranks(tmp_path):
    rank = dist.get_rank()
    coord = Coordinator()
    log = tmp_path / f"interval_{rank}.json"

    def work():
        start = time.time()
        time.sleep(0.2)
        log.write_text(json.dumps([start, time.time()]))

    coord.in_waves(2, local_rank=rank, local_world_size=4, fn=work, what="test")
    coord.barrier()
    intervals = [json.loads((tmp_path / f"interval_{r}.json").read_text()) for r in range(4)]
    for r, (start, _) in enumerate(intervals):
        overlapping = sum(1 for s, e in intervals if s <= start < e)
        assert overlapping <= 2, f"rank {r} ran alongside {overlapping - 1} others with num_workers=2"
    # Ranks 0,1 form the first wave and finish before ranks 2,3 start.
    assert max(intervals[0][1], intervals[1][1]) <= min(intervals[2][0], intervals[3][0])


@run_with_ranks(2)
def test_layout_mismatch_raises_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    nxd.initialize_model_parallel(tensor_model_parallel_size=2)
    # A dict carries no sharding (a module would be recorded, and re-sharded on load)
    nxd.save_checkpoint(ckpt, "tp2", model=TinyMLP().state_dict())
    nxd.destroy_model_parallel()
    with pytest.raises(nxd.LayoutMismatchError, match="saved with TP=2 PP=1 but this job runs TP=1 PP=1 DP=2"):
        nxd.load_checkpoint(ckpt, model=TinyMLP())
