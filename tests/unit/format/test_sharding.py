"""format/sharding.py: the TP layout arithmetic (strided chunks dealt round-robin, as NxD's create_local_weight),
split/merge round trips, read plans that cover each target exactly once, and the record's JSON."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from nxd_ckpt.errors import FormatError, ReshardError
from nxd_ckpt.format import sharding as sh
from nxd_ckpt.format.sharding import ShardingRecord, TensorSharding


def nxd_create_local_weight(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """NxD's parallel_layers/layers.py create_local_weight, written out: per-stride chunks dealt to ranks."""
    per_partition = full.shape[dim] // tp
    chunks = torch.split(full, per_partition // stride, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


CASES = [
    # (global shape, dim, stride)
    ((12, 5), 0, 1),
    ((5, 12), 1, 1),
    ((24, 3), 0, 2),  # fused gate/up
    ((36, 4), 0, 3),  # fused QKV
    ((3, 24, 2), 1, 2),
    ((3, 2, 36), 2, 3),
]


@pytest.mark.parametrize("shape,dim,stride", CASES)
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_split_matches_nxd_and_merge_round_trips(shape: tuple[int, ...], dim: int, stride: int, tp: int) -> None:
    if shape[dim] % (tp * stride):
        pytest.skip("not divisible")
    full = torch.randn(shape, dtype=torch.float64)
    s = TensorSharding(shape, dim, stride, tp)
    shards = [sh.split(full, s, tp, r) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, nxd_create_local_weight(full, dim, tp, r, stride))
        assert tuple(shard.shape) == s.local_shape(tp)
    assert torch.equal(sh.merge(shards, s), full)


def test_spans_of_stride_two() -> None:
    s = TensorSharding((8, 1), 0, 2, 2)
    assert sh.spans(s, 2, 0) == [sh.Span(0, 2, 0), sh.Span(4, 6, 2)]
    assert sh.spans(s, 2, 1) == [sh.Span(2, 4, 0), sh.Span(6, 8, 2)]


@pytest.mark.parametrize("shape,dim,stride", CASES)
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (3, 2), (2, 3), (4, 4)])
def test_read_plan_covers_each_target_index_once(
    shape: tuple[int, ...], dim: int, stride: int, src_tp: int, dst_tp: int
) -> None:
    if shape[dim] % (src_tp * stride) or shape[dim] % (dst_tp * stride):
        pytest.skip("not divisible")
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    s = TensorSharding(shape, dim, stride, src_tp)
    sources = [sh.split(full, s, src_tp, r) for r in range(src_tp)]
    for dst in range(dst_tp):
        want = sh.split(full, s, dst_tp, dst)
        out = torch.full_like(want, -1)
        covered = torch.zeros(want.shape[dim], dtype=torch.int64)
        for p in sh.pieces_to_read(s, src_tp, dst_tp, dst):
            out.narrow(dim, p.dst_start, p.size).copy_(sources[p.src_rank].narrow(dim, p.src_start, p.size))
            covered[p.dst_start : p.dst_start + p.size] += 1
        assert torch.equal(out, want)
        assert torch.equal(covered, torch.ones_like(covered))  # every index exactly once: no byte read twice


def test_read_plan_pieces_are_coalesced() -> None:
    # TP 4 -> 2, stride 1: target 0 takes sources 0 and 1 whole
    plan = sh.pieces_to_read(TensorSharding((8, 2), 0, 1, 4), 4, 2, 0)
    assert plan == [sh.Piece(0, 0, 2, 0), sh.Piece(1, 0, 2, 2)]
    # TP 1 -> 2: one contiguous half of the single source
    assert sh.pieces_to_read(TensorSharding((8, 2), 0, 1, 1), 1, 2, 1) == [sh.Piece(0, 4, 8, 0)]


def test_replicated_plan_spreads_sources() -> None:
    s = TensorSharding((3, 3))
    assert [sh.pieces_to_read(s, 2, 4, r)[0].src_rank for r in range(4)] == [0, 1, 0, 1]
    assert torch.equal(sh.merge([torch.ones(3, 3)], s), torch.ones(3, 3))


@pytest.mark.parametrize(
    "shape,box",
    [
        ((4, 6), ((0, 4), (0, 6))),
        ((4, 6), ((1, 3), (0, 6))),
        ((4, 6), ((0, 4), (2, 5))),
        ((2, 3, 4), ((0, 2), (1, 3), (0, 4))),
        ((2, 3, 4), ((1, 2), (0, 3), (1, 2))),
        ((5,), ((2, 4),)),
        ((), ()),
    ],
)
def test_element_ranges_fetch_exactly_the_box(shape: tuple[int, ...], box: sh.Box) -> None:
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    flat = full.reshape(-1)
    runs = sh.element_ranges(shape, box)
    got = torch.cat([flat[o : o + n] for o, n in runs]) if runs else torch.empty(0, dtype=full.dtype)
    assert torch.equal(got, sh.narrow_box(full, box).reshape(-1))
    assert sum(n for _, n in runs) == sh.box_numel(box)
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(runs))  # merged, in order


def test_element_ranges_rejects_a_box_outside() -> None:
    with pytest.raises(ValueError, match="outside"):
        sh.element_ranges((2, 2), ((0, 3), (0, 2)))


def test_problems_name_the_tensor_and_why() -> None:
    with pytest.raises(ReshardError, match=r"'w'.*TP=4.*does not split"):
        TensorSharding((6, 2), 0, 1, 2).check("w", 4)
    with pytest.raises(ReshardError, match="rank_ordering"):
        TensorSharding((4, 2), 0, 1, 2, rank_ordering=(1, 0)).check("w", 2)
    TensorSharding((4, 2), 0, 1, 2, rank_ordering=(0, 1)).check("w", 1)  # identity order is fine
    with pytest.raises(ReshardError, match="kv"):
        TensorSharding((4, 2), 0, 1, 2, unsupported="kv heads replicated").check("k", 1)
    TensorSharding((5, 3)).check("replicated", 7)


def test_record_json_round_trip_and_damage() -> None:
    rec = ShardingRecord(
        {
            "a.weight": TensorSharding((8, 4), 0, 3, 2, 1),
            "b": TensorSharding((4,), pp_stage=0),
            "c": TensorSharding((4, 4), 1, 1, 2, 0, rank_ordering=(0, 1), unsupported="why"),
        },
        {0: ("b", None), 1: ("a.weight",)},
    )
    doc = json.loads(json.dumps(rec.to_json()))
    assert ShardingRecord.from_json(doc) == rec
    assert doc["tensors"]["b"] == {"shape": [4], "pp": 0}
    assert doc["tensors"]["a.weight"] == {"shape": [8, 4], "dim": 0, "stride": 3, "partitions": 2, "pp": 1}
    with pytest.raises(FormatError, match="sharding"):
        ShardingRecord.from_json({"tensors": {"x": {"dim": 0}}})
    with pytest.raises(FormatError, match="sharding"):
        ShardingRecord.from_json([1, 2])


def test_require_names_the_missing_tensor() -> None:
    with pytest.raises(ReshardError, match=r"'missing\.weight'.*sharding="):
        ShardingRecord().require("missing.weight")


def test_merge_of_stage_records_and_conflicts() -> None:
    a = ShardingRecord({"x": TensorSharding((2,), pp_stage=0)}, {0: ("x",)})
    b = ShardingRecord({"y": TensorSharding((4, 2), 0, 1, 2, 1)}, {1: ("y",)})
    merged = ShardingRecord.merge([a, b, a])
    assert set(merged.tensors) == {"x", "y"} and merged.optimizer_params == {0: ("x",), 1: ("y",)}
    assert merged.names_on_stage(1) == ["y"]
    with pytest.raises(ReshardError, match="'x'"):
        ShardingRecord.merge([a, ShardingRecord({"x": TensorSharding((3,), pp_stage=0)})])


@pytest.mark.parametrize("shape,dim,stride", CASES)
@pytest.mark.parametrize("src_tp,dst_tp,dp", [(2, 1, 2), (1, 2, 3), (4, 2, 1), (2, 4, 2)])
def test_block_reads_fetch_exactly_each_target_chunk(
    shape: tuple[int, ...], dim: int, stride: int, src_tp: int, dst_tp: int, dp: int
) -> None:
    """Byte/element ranges of the source shards a target TP rank (and one ZeRO-1 row chunk of it) needs."""
    if shape[dim] % (src_tp * stride) or shape[dim] % (dst_tp * stride):
        pytest.skip("not divisible")
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    s = TensorSharding(shape, dim, stride, src_tp)
    sources = [sh.split(full, s, src_tp, r).reshape(-1) for r in range(src_tp)]
    for dst in range(dst_tp):
        want = sh.split(full, s, dst_tp, dst)
        per = -(-want.shape[0] // dp)
        for chunk in range(dp):
            rows = (min(chunk * per, want.shape[0]), min((chunk + 1) * per, want.shape[0]))
            out = torch.full_like(want[rows[0] : rows[1]], -1)
            fetched = 0
            for b in sh.block_reads(s, src_tp, dst_tp, dst, rows):
                data = torch.cat([sources[b.src_rank][o : o + n] for o, n in b.runs])
                sh.narrow_box(out, b.dst_box).copy_(data.reshape(tuple(hi - lo for lo, hi in b.src_box)))
                fetched += data.numel()
            assert torch.equal(out, want[rows[0] : rows[1]])
            assert fetched == out.numel()  # nothing read twice, nothing read that is not needed
