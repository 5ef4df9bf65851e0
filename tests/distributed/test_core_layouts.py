"""Save/load across DP, TP and PP on real spawned gloo ranks: exact files, bit-exact round trips, resume."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps


def _expected_files(tp: int, pp: int, dp: int) -> set[str]:
    files = {"checkpoint", "done", "scheduler.pt", "user_content.pt"}
    for t in range(tp):
        for p in range(pp):
            files.add(f"model/dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt")
            files.add(f"optim/dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt")
    return files


def _nxd_files(tag_dir: str) -> set[str]:
    """Files under the tag dir, minus nxd_ckpt's own extras (metadata json and the nxd_ckpt/ folder)."""
    out = set()
    for root, _, files in os.walk(tag_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), tag_dir)
            if rel == "nxd_ckpt.json" or rel.startswith("nxd_ckpt/"):
                continue
            out.add(rel)
    return out


def _round_trip(tmp_path, tp: int, pp: int) -> None:
    nxd.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    rank = dist.get_rank()
    # Each (TP, PP) coordinate holds a different model; DP replicas hold the same one.
    topo = nxd.get_manager() and __import__("nxd_ckpt.parallel_state").parallel_state.current_topology()
    coord_seed = topo.tp_rank * 10 + topo.pp_rank
    model, opt, sched = make_training(seed=coord_seed)
    train_steps(model, opt, sched, steps=3, seed=coord_seed)
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(
        ckpt, "step_3", model=model, optimizer=opt, scheduler=sched, user_content={"step": 3, "name": "run"}
    )
    if rank == 0:
        assert _nxd_files(os.path.join(ckpt, "step_3")) == _expected_files(tp, pp, topo.dp_size)
        # Plain mode: NxD reads these files with plain torch.load.
        sd = torch.load(os.path.join(ckpt, "step_3", "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
        assert set(sd) == set(model.state_dict())
    dist.barrier()
    model2, opt2, sched2 = make_training(seed=99)
    content = nxd.load_checkpoint(ckpt, model=model2, optimizer=opt2, scheduler=sched2)
    assert content == {"step": 3, "name": "run"}
    assert_state_equal(model.state_dict(), model2.state_dict())
    assert_state_equal(opt.state_dict(), opt2.state_dict())
    assert_state_equal(sched.state_dict(), sched2.state_dict())
    # Resumed training continues exactly.
    assert train_steps(model, opt, sched, 3, seed=coord_seed + 1) == train_steps(
        model2, opt2, sched2, 3, seed=coord_seed + 1
    )


@run_with_ranks(4)
def test_dp4_round_trip(tmp_path):
    _round_trip(tmp_path, tp=1, pp=1)


@run_with_ranks(4)
def test_tp2_dp2_round_trip(tmp_path):
    _round_trip(tmp_path, tp=2, pp=1)


@run_with_ranks(8, timeout=300)
def test_tp2_pp2_dp2_round_trip(tmp_path):
    _round_trip(tmp_path, tp=2, pp=2)
