"""Under NxD's parallel state, files carry NxD's coordinates: trn1's non-contiguous TP=4 groups and trn2's ring.

The parallel state is a fake NxD ``parallel_state`` module (``harness.fake_nxd``) holding group lists
written out literally from NxD's layouts; each rank's coordinates are asked of that module, never of nxd_ckpt.
Each rank holds the TP shard its NxD TP rank owns; after a save, ``tp_rank_XX`` must hold shard XX and
``optim/dp_rank_DD_tp_rank_XX`` the ZeRO-1 state of the rank whose NxD coordinates are (DD, XX); a load must
give every rank back exactly its own state.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness import fake_nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt import statefile
from nxd_ckpt.storage import storage_for

pytestmark = pytest.mark.device_independent  # NxD's rank groups: runs once, in the CPU lane

# trn1, TP=4, 8 ranks on one node (NxD: "with 8 local ranks: TP groups [0,2,4,6], [1,3,5,7]")
TRN1_8 = {"tp": [[0, 2, 4, 6], [1, 3, 5, 7]], "dp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
# trn1, TP=4, 16 ranks on two nodes of 8
TRN1_16 = {
    "tp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "dp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
}
# trn2's ascending-descending ring on a node of 8 ranks in 4 rows of 2: TP groups are rows 1+4 and 2+3, DP
# groups zip them, so [6, 4] has DP rank 0 at rank 6 (NxD's getters use list positions for DP here).
TRN2_RING_8 = {"tp": [[0, 1, 6, 7], [2, 3, 4, 5]], "dp": [[0, 2], [1, 3], [6, 4], [7, 5]]}

ROWS, COLS = 8, 3


def _full_weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1234))


def _zero1_state(tp: int, dp: int) -> dict:
    g = torch.Generator().manual_seed(100 * tp + dp)
    return {
        "param_groups": [{"params": [0], "lr": 0.1}],
        "base_state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, COLS, generator=g)}},
        "shape_info": {0: [4, COLS]},
    }


def _read(storage, path):
    return statefile.read_state_file(storage, path, trusted=False)


def _literal_coords(groups: dict) -> tuple[int, int, int, int]:
    """(tp, dp, tp size, dp size) of this rank from literal group lists (sorted positions)."""
    rank = dist.get_rank()
    tp_group = next(g for g in groups["tp"] if rank in g)
    dp_group = next(g for g in groups["dp"] if rank in g)
    return sorted(tp_group).index(rank), sorted(dp_group).index(rank), len(tp_group), len(dp_group)


def _round_trip(
    tmp_path, groups: dict, *, zero1: bool, use_xser: bool, list_indexed: bool = False, own_tp: int = 0
) -> None:
    if own_tp:  # nxd_ckpt's own initialize_model_parallel must build these very groups
        nxd.initialize_model_parallel(tensor_model_parallel_size=own_tp)
        tp, dp, tp_size, dp_size = _literal_coords(groups)
    else:
        mod = fake_nxd.install(**groups, list_indexed_dp_pp=list_indexed)
        tp, dp = mod.get_tensor_model_parallel_rank(), mod.get_data_parallel_rank()
        tp_size = mod.get_tensor_model_parallel_size()
        dp_size = mod.get_data_parallel_size()
    try:
        shard = _full_weight().chunk(tp_size)[tp].clone()
        model = {"w": shard, "b": torch.full((2,), float(tp))}
        optimizer = _zero1_state(tp, dp) if zero1 else {"state": {"m": shard * 2}, "param_groups": [{"lr": 1.0}]}
        ckpt = str(tmp_path / "ckpt")
        nxd.save_checkpoint(ckpt, "s1", model=model, optimizer=optimizer, zero1_optimizer=zero1, use_xser=use_xser)
        if dist.get_rank() == 0:
            storage = storage_for(ckpt)
            names = sorted(os.listdir(os.path.join(ckpt, "s1", "model")))
            assert [n for n in names if n.endswith("pp_rank_00.pt")] == [
                f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt" for t in range(tp_size)
            ]
            for t in range(tp_size):
                saved = _read(storage, f"s1/model/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")
                assert torch.equal(saved["w"], _full_weight().chunk(tp_size)[t]), f"tp_rank_{t:02d} holds another shard"
                if zero1:
                    for d in range(dp_size):
                        st = _read(storage, f"s1/optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt")
                        want = _zero1_state(t, d)["base_state"][0]["exp_avg"]
                        assert torch.equal(st["base_state"][0]["exp_avg"], want)
                else:
                    st = _read(storage, f"s1/optim/dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt")
                    assert torch.equal(st["state"]["m"], _full_weight().chunk(tp_size)[t] * 2)
        dist.barrier()
        model2 = {"w": torch.zeros_like(shard), "b": torch.zeros(2)}
        optimizer2: dict = {}
        nxd.load_checkpoint(ckpt, "s1", model=model2, optimizer=optimizer2)
        assert torch.equal(model2["w"], shard) and torch.equal(model2["b"], model["b"])
        if zero1:
            assert torch.equal(optimizer2["base_state"][0]["exp_avg"], optimizer["base_state"][0]["exp_avg"])
            assert optimizer2["shape_info"] == optimizer["shape_info"]
        else:
            assert torch.equal(optimizer2["state"]["m"], shard * 2)
    finally:
        nxd.reset_manager()
        fake_nxd.uninstall()


@run_with_ranks(8, timeout=300)
def test_trn1_tp4_8_ranks_plain_zero1(tmp_path):
    _round_trip(tmp_path, TRN1_8, zero1=True, use_xser=False)


@run_with_ranks(8, timeout=300, env={"NXD_CKPT_PLATFORM": "trn1", "LOCAL_WORLD_SIZE": "8"})
def test_own_initialize_model_parallel_trn1_tp4_plain_zero1(tmp_path):
    _round_trip(tmp_path, TRN1_8, zero1=True, use_xser=False, own_tp=4)


@run_with_ranks(8, timeout=300)
def test_trn1_tp4_8_ranks_xser_replicated(tmp_path):
    _round_trip(tmp_path, TRN1_8, zero1=False, use_xser=True)


@run_with_ranks(16, timeout=420)
def test_trn1_tp4_16_ranks_plain_zero1(tmp_path):
    _round_trip(tmp_path, TRN1_16, zero1=True, use_xser=False)


@run_with_ranks(8, timeout=300)
def test_trn2_ring_layout_xser_zero1(tmp_path):
    _round_trip(tmp_path, TRN2_RING_8, zero1=True, use_xser=True, list_indexed=True)


@run_with_ranks(8, timeout=300)
def test_trn2_ring_layout_plain_replicated(tmp_path):
    _round_trip(tmp_path, TRN2_RING_8, zero1=False, use_xser=False, list_indexed=True)
