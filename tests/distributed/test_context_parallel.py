"""Context parallelism as NxD does it: CP is its own dimension, not DP.

8 ranks, TP=2, CP=2, DP=2: NxD's non-expert grid ``[PP, DP, CP, TP]``. CP ranks hold the same model as their
DP replicas (NxD saves models over expert-data-parallel groups, which span DP x CP), so model and replicated
optimizer files are NxD's ``dp_rank_00_tp_rank_XX``. ZeRO-1 shards over DP x CP (NxD's
``get_zero1_sharding_groups``, DP-major): shard ``dp * CP + cp`` is named ``dp_rank_<that index>``, since NxD's own
name (the DP rank alone) would give two CP ranks the same file.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness import fake_nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt import statefile
from nxd_ckpt.storage import storage_for

CP_GROUPS = {  # written out from NxD's row-major [PP, DP, CP, TP] grid (CP stride TP, DP stride CP*TP)
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
}


def _weight(tp: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(50 + tp))


def _zero1(shard: int, tp: int) -> dict:
    g = torch.Generator().manual_seed(500 + 10 * tp + shard)
    return {
        "param_groups": [{"params": [0], "lr": 0.1}],
        "base_state": {0: {"exp_avg": torch.randn(1, 3, generator=g)}},
        "shape_info": {0: [4, 3]},
    }


def _round_trip(tmp_path, *, use_xser: bool, own_groups: bool) -> None:
    if own_groups:
        nxd.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        rank = dist.get_rank()
        tp, cp, dp = rank % 2, (rank // 2) % 2, rank // 4  # NxD's documented grid, for checking only
    else:
        mod = fake_nxd.install(**CP_GROUPS)
        tp, cp, dp = (
            mod.get_tensor_model_parallel_rank(),
            mod.get_context_model_parallel_rank(),
            mod.get_data_parallel_rank(),
        )
    try:
        shard = dp * 2 + cp
        model = {"w": _weight(tp)}
        ckpt = str(tmp_path / "ckpt")
        nxd.save_checkpoint(
            ckpt, "s1", model=model, optimizer=_zero1(shard, tp), zero1_optimizer=True, use_xser=use_xser
        )
        if dist.get_rank() == 0:
            storage = storage_for(ckpt)
            names = sorted(n for n in os.listdir(os.path.join(ckpt, "s1", "model")) if n.endswith("00.pt"))
            assert names == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_01_pp_rank_00.pt"]
            for t in (0, 1):
                saved = statefile.read_state_file(storage, f"s1/model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")
                assert torch.equal(saved["w"], _weight(t))
                for s in range(4):
                    st = statefile.read_state_file(storage, f"s1/optim/dp_rank_{s:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
                    assert torch.equal(st["base_state"][0]["exp_avg"], _zero1(s, t)["base_state"][0]["exp_avg"])
            assert nxd.verify(ckpt, "s1").ok
        dist.barrier()
        model2, opt2 = {"w": torch.zeros(4, 3)}, {}
        nxd.load_checkpoint(ckpt, "s1", model=model2, optimizer=opt2)
        assert torch.equal(model2["w"], _weight(tp))
        assert torch.equal(opt2["base_state"][0]["exp_avg"], _zero1(shard, tp)["base_state"][0]["exp_avg"])
    finally:
        nxd.reset_manager()
        fake_nxd.uninstall()


@run_with_ranks(8, timeout=300)
def test_cp2_tp2_dp2_under_nxd_plain(tmp_path):
    _round_trip(tmp_path, use_xser=False, own_groups=False)


@run_with_ranks(8, timeout=300)
def test_cp2_tp2_dp2_own_groups_xser(tmp_path):
    _round_trip(tmp_path, use_xser=True, own_groups=True)
