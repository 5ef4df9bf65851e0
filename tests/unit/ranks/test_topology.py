"""Rank grid arithmetic and NxD file names."""

from __future__ import annotations

import pytest

from nxd_ckpt.errors import InvalidTagError
from nxd_ckpt.format import layout
from nxd_ckpt.ranks.topology import Topology


def test_rank_grid_is_row_major_pp_dp_tp():
    # The format doc's example: TP=2, PP=2, DP=2, rank 5 is pp=1, dp=0, tp=1.
    t = Topology(tp_size=2, pp_size=2, dp_size=2, rank=5)
    assert (t.pp_rank, t.dp_rank, t.tp_rank) == (1, 0, 1)
    assert t.world_size == 8
    assert t.dp_group_ranks() == [5, 7]
    for r in range(8):
        assert t.rank_of(*t.coords_of(r)) == r


def test_topology_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        Topology(tp_size=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        Topology(dp_size=4, rank=4)


def test_file_names_match_nxd():
    assert layout.model_file("step_3", tp=1, pp=2) == "step_3/model/dp_rank_00_tp_rank_01_pp_rank_02.pt"
    assert layout.optim_file("s", dp=3, tp=0, pp=0) == "s/optim/dp_rank_03_tp_rank_00_pp_rank_00.pt"
    assert layout.full_optim_file("s", 1, 0) == "s/optim/full_tp_rank_01_pp_rank_00.pt"
    assert layout.parse_state_file_name("dp_rank_03_tp_rank_01_pp_rank_02.pt") == (3, 1, 2)
    assert layout.parse_state_file_name("dp_rank_03_tp_rank_01_pp_rank_02.pt.info.pt") is None
    assert layout.xser_tensor_file("s/model/x.pt", 7) == "s/model/x.pt.tensors/tensor_7.pt"


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "../x", "/abs", ".hidden", "a\\b", "x" * 201, 3, None])
def test_bad_tags_are_rejected_with_a_clear_message(bad):
    with pytest.raises(InvalidTagError, match="tag"):
        layout.validate_tag(bad)


@pytest.mark.parametrize("good", ["step_1200", "epoch-3.step-7", "v1+2", "a"])
def test_plain_tags_are_accepted(good):
    assert layout.validate_tag(good) == good
