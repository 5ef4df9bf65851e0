"""ZeRO-1 across a DP change on real gloo ranks: DP=4 trains and saves, DP=2 loads and trains on.

The DP=2 job loads both the offline-converted checkpoint and the original one (re-sharded online by
load_checkpoint) and must see the same losses as the DP=4 job that never stopped. The optimizer is a real
sharded AdamW (nxd_ckpt.testing.zero1_adamw): each rank only holds its chunk of the moments.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import TinyMLP
from nxd_ckpt.testing.multiprocess import run_on_ranks
from nxd_ckpt.testing.zero1_adamw import Zero1AdamW
from nxd_ckpt.tools.convert_zero1 import convert_zero1

GLOBAL_BATCH = 12
STEPS_BEFORE, STEPS_AFTER = 3, 4


def _setup(seed: int) -> tuple[torch.nn.Module, Zero1AdamW, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(seed)
    model = TinyMLP(d_hidden=10)  # 10 rows: padded to 12 for DP=4, split 5/5 for DP=2
    opt = Zero1AdamW(model.parameters(), lr=2e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: Zero1AdamW, sched, first_step: int, steps: int) -> list[float]:
    """Data-parallel steps on a fixed global batch per step; returns the global mean losses."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = GLOBAL_BATCH // world
    losses = []
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _save_dp4(ckpt: str, out: str, use_xser: bool) -> None:
    model, opt, sched = _setup(seed=0)
    _train(model, opt, sched, 0, STEPS_BEFORE)
    # Each rank really holds only its quarter (padded) of every moment.
    assert opt.state_dict()["base_state"][0]["exp_avg"].shape == (3, 8)
    nxd.save_checkpoint(
        ckpt, "step_3", model=model, optimizer=opt, scheduler=sched, zero1_optimizer=True, use_xser=use_xser
    )
    reference = _train(model, opt, sched, STEPS_BEFORE, STEPS_AFTER)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(reference, f)


def _load_dp2(ckpt: str, converted: str, out: str) -> None:
    results = {}
    for name, where in (("online", ckpt), ("offline", converted)):
        model, opt, sched = _setup(seed=123)
        nxd.load_checkpoint(where, "step_3", model=model, optimizer=opt, scheduler=sched)
        state = opt.state_dict()
        assert state["base_state"][0]["exp_avg"].shape == (5, 8)
        assert float(state["base_state"][0]["step"]) == STEPS_BEFORE
        results[name] = _train(model, opt, sched, STEPS_BEFORE, STEPS_AFTER)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_dp4_save_dp2_resume_same_losses(tmp_path, use_xser):
    ckpt, converted = str(tmp_path / "ckpt"), str(tmp_path / "converted")
    ref_file, got_file = str(tmp_path / "reference.json"), str(tmp_path / "resumed.json")
    run_on_ranks(_save_dp4, 4, {"ckpt": ckpt, "out": ref_file, "use_xser": use_xser})
    report = convert_zero1(os.path.join(ckpt, "step_3"), os.path.join(converted, "step_3"), dp_size=2)
    assert (report.src_dp, report.dst_dp, report.xser) == (4, 2, use_xser)
    assert nxd.list_checkpoint_tags(converted) == ["step_3"]
    run_on_ranks(_load_dp2, 2, {"ckpt": ckpt, "converted": converted, "out": got_file})
    with open(ref_file) as f:
        reference = json.load(f)
    with open(got_file) as f:
        resumed = json.load(f)
    for name in ("online", "offline"):
        assert resumed[name] == pytest.approx(reference, rel=1e-5, abs=1e-7), name
