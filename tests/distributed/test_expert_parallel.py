"""Expert parallelism as NxD does it: EP=2 with TP=2 and DP=4 (expert-DP 2) on 8 gloo ranks.

The parallel state is a fake NxD ``parallel_state`` with NxD's row-major groups written out literally:
non-expert grid ``[PP, DP, TP]`` and expert grid ``[PP, EDP, EP, TP]`` (EP stride TP, expert-DP stride EP*TP).
Model files are ``dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_00.pt``; xser info files mark expert tensors
``expert_model_parallel``; ZeRO-1 shards are named by the (non-expert) DP rank; a checkpoint whose ``ep_rank_01``
folders lack non-expert tensors (NxD writes those only under ``ep_rank_00``) still loads.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness import fake_nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt import statefile
from nxd_ckpt.errors import FormatError
from nxd_ckpt.storage import storage_for
from nxd_ckpt.tools.convert_zero1 import convert_zero1

pytestmark = pytest.mark.usefixtures("xser_file_per_tensor")  # NxD-style tensor files for every tensor

EP_GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


def _tensor(*seed: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1000 + 100 * seed[0] + sum(seed[1:])))


def _model(ep: int, tp: int) -> dict:
    experts = _tensor(1, ep, 10 * tp)
    experts.expert_model_parallel = True  # NxD's mark on expert parameters
    return {"dense.w": _tensor(2, tp), "experts.w": experts}


def _zero1(dp: int, tp: int) -> dict:
    return {
        "param_groups": [{"params": [0, 1], "lr": 0.1}],
        "base_state": {0: {"exp_avg": _tensor(3, dp, 10 * tp)[:2]}, 1: {"exp_avg": _tensor(4, dp, 10 * tp)[:1]}},
        "shape_info": {0: [8, 4], 1: [4, 4]},
    }


def _round_trip(tmp_path, *, use_xser: bool, zero1: bool) -> None:
    mod = fake_nxd.install(**EP_GROUPS)
    try:
        tp, dp = mod.get_tensor_model_parallel_rank(), mod.get_data_parallel_rank()
        ep = mod.get_expert_model_parallel_rank()
        model = _model(ep, tp)
        optimizer = _zero1(dp, tp) if zero1 else {"state": {"m": _tensor(5, ep, 10 * tp)}, "param_groups": []}
        ckpt = str(tmp_path / "ckpt")
        nxd.save_checkpoint(ckpt, "s1", model=model, optimizer=optimizer, zero1_optimizer=zero1, use_xser=use_xser)
        tag_dir = os.path.join(ckpt, "s1")
        if dist.get_rank() == 0:
            storage = storage_for(ckpt)
            want_model = {f"dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for e in (0, 1) for t in (0, 1)}
            assert {n for n in os.listdir(os.path.join(tag_dir, "model")) if n.endswith("00.pt")} == want_model
            for e in (0, 1):
                for t in (0, 1):
                    path = f"s1/model/dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt"
                    saved = statefile.read_state_file(storage, path)
                    assert torch.equal(saved["experts.w"], _model(e, t)["experts.w"])
                    assert torch.equal(saved["dense.w"], _model(e, t)["dense.w"])
                    if use_xser:
                        info = torch.load(os.path.join(ckpt, path + ".info.pt"))
                        flags = sorted(v["expert_model_parallel"] for v in info.values())
                        assert flags == [False, True]
            optim = sorted(os.listdir(os.path.join(tag_dir, "optim")))
            if zero1:  # ZeRO-1 shards are named by the non-expert DP rank, without the EP rank (as NxD names them)
                assert [n for n in optim if n.endswith("00.pt")] == [
                    f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(4) for t in (0, 1)
                ]
                with pytest.raises(FormatError, match="expert parallelism"):
                    convert_zero1(tag_dir, os.path.join(ckpt, "full"), convert_to_full=True)
            else:
                assert [n for n in optim if n.endswith("00.pt")] == sorted(
                    f"dp_rank_00_ep_rank_{e:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for e in (0, 1) for t in (0, 1)
                )
            report = nxd.verify(ckpt, "s1")
            assert report.ok, report.problems
            assert nxd.open_checkpoint(ckpt, "s1").layout().ep == 2
        dist.barrier()
        model2 = {"dense.w": torch.zeros(6, 4), "experts.w": torch.zeros(6, 4)}
        optimizer2: dict = {}
        nxd.load_checkpoint(ckpt, "s1", model=model2, optimizer=optimizer2)
        assert torch.equal(model2["experts.w"], model["experts.w"]) and torch.equal(model2["dense.w"], model["dense.w"])
        if zero1:
            assert torch.equal(optimizer2["base_state"][0]["exp_avg"], optimizer["base_state"][0]["exp_avg"])
        else:
            assert torch.equal(optimizer2["state"]["m"], optimizer["state"]["m"])
        if use_xser:
            # NxD writes non-expert tensors only into the ep_rank_00 files' folders; its loader reads them there.
            dist.barrier()
            if dist.get_rank() == 0:
                for t in (0, 1):
                    path = os.path.join(tag_dir, "model", f"dp_rank_00_ep_rank_01_tp_rank_{t:02d}_pp_rank_00.pt")
                    info = torch.load(path + ".info.pt")
                    for tid, entry in info.items():
                        if not entry["expert_model_parallel"]:
                            os.remove(os.path.join(path + ".tensors", f"tensor_{tid}.pt"))
                shutil.rmtree(os.path.join(tag_dir, "nxd_ckpt"))  # as NxD wrote it: no manifests
            dist.barrier()
            model3 = {"dense.w": torch.zeros(6, 4), "experts.w": torch.zeros(6, 4)}
            nxd.load_checkpoint(ckpt, "s1", model=model3, skip_rank_state=True)
            assert torch.equal(model3["experts.w"], model["experts.w"])
            assert torch.equal(model3["dense.w"], model["dense.w"])
    finally:
        nxd.reset_manager()
        fake_nxd.uninstall()


@run_with_ranks(8, timeout=300)
def test_ep2_tp2_dp4_plain_zero1(tmp_path):
    _round_trip(tmp_path, use_xser=False, zero1=True)


@run_with_ranks(8, timeout=300)
def test_ep2_tp2_dp4_xser_replicated(tmp_path):
    _round_trip(tmp_path, use_xser=True, zero1=False)


@run_with_ranks(8, timeout=300)
def test_ep2_tp2_dp4_xser_zero1(tmp_path):
    _round_trip(tmp_path, use_xser=True, zero1=True)
