"""zero1.py: ZeRO-1 shard arithmetic checked against an independent pad-and-chunk written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxd_ckpt.errors import FormatError
from nxd_ckpt.load import zero1
from nxd_ckpt.testing.fakes import assert_state_equal


def xla_shard(full: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """torch_xla's ZeroRedundancyOptimizer._shard_tensor: pad dim 0 to a multiple of dp, chunk, take one."""
    if full.size(0) % dp:
        full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, dp - full.size(0) % dp])
    return full.chunk(dp)[rank]


def independent_merge(shards: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.cat(shards)[:rows]


def full_state(shapes: dict[int, tuple[int, ...]], master: bool = True) -> dict:
    g = torch.Generator().manual_seed(7)
    state = {
        "state": {},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": list(shapes)}],
        "base_state": {
            i: {
                "step": torch.tensor(4.0),
                "exp_avg": torch.randn(s, generator=g),
                "exp_avg_sq": torch.rand(s, generator=g),
            }
            for i, s in shapes.items()
        },
        "shape_info": {i: torch.Size(s) for i, s in shapes.items()},
    }
    if master:
        state["sharded_master_weights"] = {i: torch.randn(s, generator=g) for i, s in shapes.items()}
    return state


def independent_shard_state(full: dict, dp: int, rank: int) -> dict:
    out = dict(full)
    out["base_state"] = {
        i: {k: (v if k == "step" else xla_shard(v, dp, rank)) for k, v in per.items()}
        for i, per in full["base_state"].items()
    }
    if "sharded_master_weights" in full:
        out["sharded_master_weights"] = {i: xla_shard(v, dp, rank) for i, v in full["sharded_master_weights"].items()}
    return out


SHAPES = {0: (10, 3), 1: (7,), 2: (1, 4), 3: (12, 2, 2)}


def test_row_arithmetic():
    assert zero1.chunk_rows(10, 4) == 3 and zero1.chunk_rows(10, 1) == 10 and zero1.chunk_rows(1, 4) == 1
    assert [zero1.shard_rows(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert zero1.shard_rows(1, 4, 3) == (1, 1)  # all padding
    assert zero1.shard_shape((10, 3), 4) == (3, 3)
    with pytest.raises(ValueError):
        zero1.chunk_rows(10, 0)


@pytest.mark.parametrize("rows", [1, 2, 5, 10, 12, 13])
@pytest.mark.parametrize("src_dp", [1, 2, 3, 4])
@pytest.mark.parametrize("dst_dp", [1, 2, 3, 4, 5])
def test_slice_plan_matches_independent_reshard(rows, src_dp, dst_dp):
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1
    sources = [xla_shard(full, src_dp, r) for r in range(src_dp)]
    for rank in range(dst_dp):
        plan = zero1.slice_plan(rows, src_dp, dst_dp, rank)
        out = torch.full(zero1.shard_shape(full.shape, dst_dp), -1.0)
        zero1.assemble(plan, sources, out)
        assert torch.equal(out, xla_shard(full, dst_dp, rank)), (rows, src_dp, dst_dp, rank, plan)
        assert all(p.rows > 0 and p.src_stop <= zero1.chunk_rows(rows, src_dp) for p in plan)


def test_shard_and_merge_tensor():
    full = torch.randn(10, 3)
    shards = [zero1.shard_tensor(full, 4, r) for r in range(4)]
    for r, s in enumerate(shards):
        assert torch.equal(s, xla_shard(full, 4, r))
    assert torch.equal(zero1.merge_shards(shards, 10), full)
    assert torch.equal(independent_merge(shards, 10), full)


@pytest.mark.parametrize(("src_dp", "dst_dp"), [(4, 2), (2, 4), (4, 3), (3, 1), (1, 3)])
def test_reshard_states(src_dp, dst_dp):
    full = full_state(SHAPES)
    sources = [independent_shard_state(full, src_dp, r) for r in range(src_dp)]
    out = zero1.reshard_states(sources, dst_dp)
    assert len(out) == dst_dp
    for r in range(dst_dp):
        assert_state_equal(out[r], independent_shard_state(full, dst_dp, r))


def test_merge_and_shard_round_trip_keeps_everything():
    full = full_state(SHAPES)
    shards = [zero1.shard_state(full, 3, r) for r in range(3)]
    assert shards[1]["base_state"][0]["exp_avg"].shape == (4, 3)  # 10 rows -> padded to 12
    assert float(shards[2]["base_state"][1]["step"]) == 4.0  # scalars copied, not split
    merged = zero1.merge_states(shards)
    assert_state_equal(merged, full)
    for i, s in SHAPES.items():  # independent merge of each slot
        got = independent_merge([sh["base_state"][i]["exp_avg_sq"] for sh in shards], s[0])
        assert torch.equal(got, full["base_state"][i]["exp_avg_sq"])


def test_state_without_master_weights():
    full = full_state({0: (5, 2)}, master=False)
    out = zero1.reshard_states([full], 2)
    assert "sharded_master_weights" not in out[0]
    assert_state_equal(out[1], independent_shard_state(full, 2, 1))


def test_shard_paths_skip_step_and_scalars():
    state = full_state({0: (5, 2)})
    state["base_state"][0]["step"] = torch.tensor([3.0])  # even a 1-d step is copied, never split
    paths = zero1.sharded_paths(state)
    assert set(paths) == {("base_state", 0, "exp_avg"), ("base_state", 0, "exp_avg_sq"), ("sharded_master_weights", 0)}
    assert torch.equal(zero1.shard_state(state, 2, 1)["base_state"][0]["step"], torch.tensor([3.0]))


def test_bad_states_raise_clear_errors():
    with pytest.raises(FormatError, match="not a ZeRO-1 optimizer state"):
        zero1.reshard_states([{"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": []}], 2)
    full = full_state({0: (10, 3)})
    shards = [zero1.shard_state(full, 2, r) for r in range(2)]
    shards[1]["base_state"][0]["exp_avg"] = torch.zeros(4, 3)  # DP=2 shards of 10 rows have 5
    with pytest.raises(FormatError, match=r"shape \(4, 3\).*shape_info says \(10, 3\).*\(5, 3\)"):
        zero1.reshard_states(shards, 3)
    zero_d = full_state({0: (3,)})
    zero_d["shape_info"][0] = torch.Size([])
    with pytest.raises(FormatError, match="0-d shape"):
        zero1.full_shapes(zero_d)
