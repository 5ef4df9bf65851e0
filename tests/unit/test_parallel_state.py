"""nxd_ckpt's own initialize_model_parallel builds NxD's groups; the rank table refuses inconsistent groups.

Expected group lists are written out from NxD's own documentation (its initialize_model_parallel docstring and
comments, release 2.29, and docs/nxd-format.md), not computed with nxd_ckpt's code.
"""

from __future__ import annotations

import pytest

from harness import fake_nxd
from nxd_ckpt import parallel_state
from nxd_ckpt.ranks.topology import LayoutError, RankGroups, Topology, build_nxd_groups, detect_platform


def _topo(groups: RankGroups, rank: int = 0) -> Topology:
    return Topology.from_groups(groups, rank)


def test_trn1_tp4_two_nodes_matches_nxd_comment():
    # NxD: "TP=4 PP=1 on 2 trn1.32xl nodes (64 NeuronCores)": 16 TP groups, 4 DP groups.
    g = build_nxd_groups(64, 4, platform="trn1", local_world_size=32)
    assert list(g.tp[:3]) == [(0, 8, 16, 24), (1, 9, 17, 25), (2, 10, 18, 26)]
    assert g.tp[7] == (7, 15, 23, 31)
    assert g.tp[8] == (32, 40, 48, 56) and g.tp[15] == (39, 47, 55, 63)
    assert len(g.tp) == 16
    assert list(g.dp) == [
        (*range(0, 8), *range(32, 40)),
        (*range(8, 16), *range(40, 48)),
        (*range(16, 24), *range(48, 56)),
        (*range(24, 32), *range(56, 64)),
    ]
    assert sorted(g.pp) == [(r,) for r in range(64)]
    t = _topo(g, rank=9)
    assert (t.tp_rank, t.dp_rank, t.pp_rank) == (1, 1, 0)  # rank 9 is 2nd of [1,9,17,25]; 2nd of DP group 1
    assert t.replica_ranks() == [*range(8, 16), *range(40, 48)]


def test_trn1_tp4_eight_and_sixteen_local_ranks():
    g8 = build_nxd_groups(8, 4, platform="trn1", local_world_size=8)
    assert list(g8.tp) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert list(g8.dp) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    g16 = build_nxd_groups(16, 4, platform="trn1", local_world_size=8)
    assert list(g16.tp) == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert list(g16.dp) == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    # rank 4 is TP rank 2 (not 4 % 4 = 0): the bug this layout fixes
    assert Topology.from_groups(g8, 4).tp_rank == 2


def test_trn1_tp4_refuses_expert_parallelism_and_bad_node_sizes():
    with pytest.raises(ValueError, match="expert parallelism"):
        build_nxd_groups(16, 4, expert_model_parallel_size=2, platform="trn1", local_world_size=8)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        build_nxd_groups(16, 4, platform="trn1", local_world_size=6)


def test_other_platforms_keep_tp4_contiguous():
    assert list(build_nxd_groups(8, 4, platform="trn2").tp) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert list(build_nxd_groups(8, 4, platform="generic").tp) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_row_major_example_from_nxd_docstring_with_expert_parallelism():
    # NxD docstring example 3: 128 devices, TP=8, PP=4, EP=2 -> DP_nonexp=4, DP_exp=2.
    g = build_nxd_groups(128, 8, 4, expert_model_parallel_size=2)
    assert g.pp[0] == (0, 32, 64, 96) and g.pp[1] == (1, 33, 65, 97) and g.pp[-1] == (31, 63, 95, 127)
    assert g.dp[0] == (0, 8, 16, 24) and g.dp[-1] == (103, 111, 119, 127)
    assert g.edp[0] == (0, 16) and g.edp[1] == (1, 17) and g.edp[-1] == (111, 127)
    assert g.ep[0] == (0, 8) and g.ep[-1] == (119, 127)
    assert g.tp[0] == tuple(range(8)) and g.tp[-1] == tuple(range(120, 128))
    t = _topo(g, rank=13)
    assert (t.tp_rank, t.dp_rank, t.ep_rank, t.edp_rank, t.pp_rank) == (5, 1, 1, 0, 0)
    assert t.replica_ranks() == [13, 29]  # expert-DP replicas hold this EP rank's model file


def test_context_parallel_example_from_nxd_docstring():
    # NxD docstring example 2: 32 devices, TP=8, CP=4 -> DP=1; CP groups strided by TP.
    g = build_nxd_groups(32, 8, context_parallel_size=4)
    assert g.cp[0] == (0, 8, 16, 24) and g.cp[7] == (7, 15, 23, 31)
    assert list(g.dp) == [(r,) for r in range(32)]
    t = _topo(g, rank=17)
    assert (t.cp_rank, t.dp_rank, t.tp_rank) == (2, 0, 1)
    # CP ranks are replicas of the model (NxD saves models over expert-DP groups = DP x CP) and ZeRO-1 shards
    # over DP x CP (NxD's get_zero1_sharding_groups).
    assert t.replica_ranks() == [1, 9, 17, 25]
    assert (t.zero1_size, t.zero1_rank) == (4, 2)


def test_row_major_default_grid():
    t = Topology(tp_size=2, pp_size=2, dp_size=2, rank=5)
    assert (t.pp_rank, t.dp_rank, t.tp_rank) == (1, 0, 1)


def test_trn2_ring_layout_for_tp32_on_64_ranks():
    g = build_nxd_groups(64, 32, platform="trn2", lnc_size=2, local_world_size=64)
    assert list(g.tp) == [(*range(0, 16), *range(48, 64)), (*range(16, 32), *range(32, 48))]
    assert g.dp[0] == (0, 16) and g.dp[15] == (15, 31) and g.dp[16] == (48, 32) and g.dp[31] == (63, 47)
    t48, t32 = _topo(g, 48), _topo(g, 32)
    assert (t48.tp_rank, t48.dp_rank) == (16, 0)  # DP rank is the list position ([48, 32]), not sorted order
    assert (t32.tp_rank, t32.dp_rank) == (16, 1)
    assert t48.replica_ranks() == [48, 32]
    # fewer than 64 ranks with LNC 2: NxD falls back to the row-major layout
    assert build_nxd_groups(32, 32, platform="trn2", lnc_size=2).tp == (tuple(range(32)),)


def test_platform_detection_override(monkeypatch):
    monkeypatch.setenv("NXD_CKPT_PLATFORM", "trn1n")
    assert detect_platform() == "trn1"
    assert detect_platform("trn2") == "trn2"
    monkeypatch.setenv("NXD_CKPT_PLATFORM", "nonsense")
    with pytest.raises(ValueError, match="unknown Neuron platform"):
        detect_platform()


def test_initialize_model_parallel_uses_platform_override(monkeypatch):
    monkeypatch.setattr(parallel_state, "_world_size", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    groups = parallel_state.initialize_model_parallel(4, platform="trn1", mesh_only=True)
    assert groups is not None and list(groups.tp) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert not parallel_state.model_parallel_is_initialized()  # mesh_only configures nothing


def _groups(**kw):
    base = {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]]}
    base.update(kw)
    singles = [[r] for r in range(4)]
    return RankGroups(
        tp=base["tp"], dp=base["dp"], pp=base["pp"], cp=singles, ep=singles, edp=base.get("edp", base["dp"])
    )


def test_rank_seen_twice_fails_loudly():
    with pytest.raises(LayoutError, match="rank 1 appears twice"):
        _topo(_groups(tp=[[0, 1], [1, 3]]))


def test_rank_missing_fails_loudly():
    with pytest.raises(LayoutError, match="leave ranks"):
        _topo(_groups(tp=[[0, 1]]))
    with pytest.raises(LayoutError, match="do not have the size"):
        _topo(_groups(dp=[[0, 2], [1], [3]]))


def test_groups_that_do_not_form_a_grid_fail_loudly():
    # DP groups pairing TP rank 0 with TP rank 1 would make two ranks write the same file
    with pytest.raises(LayoutError, match="inconsistent"):
        _topo(_groups(dp=[[0, 3], [1, 2]]))


def test_nxd_getters_must_agree_with_nxd_groups(monkeypatch):
    monkeypatch.setattr(parallel_state, "_world_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "_rank", lambda: 0)
    try:
        mod = fake_nxd.install(tp=[[0, 1], [2, 3]], dp=[[0, 2], [1, 3]])
        t = parallel_state.current_topology()  # the fake answers as NxD does: consistent
        assert (t.tp_rank, t.dp_rank, t.tp_size, t.dp_size) == (0, 0, 2, 2)
        mod.get_tensor_model_parallel_rank = lambda: 1  # type: ignore[attr-defined]
        with pytest.raises(LayoutError, match=r"get_tensor_model_parallel_rank\(\) = 1"):
            parallel_state.current_topology()
    finally:
        fake_nxd.uninstall()
