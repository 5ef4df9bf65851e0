"""format/sharding_marks.py: records read off NxD's tensor-parallel attributes on a model's parameters (GQA QKV
layers included), off name-pattern specs, and re-based to another TP size."""

from __future__ import annotations

import pytest
import torch

from nxd_ckpt.errors import ReshardError
from nxd_ckpt.format import sharding_marks as sh
from nxd_ckpt.format.sharding import TensorSharding


def _mark(t: torch.Tensor, dim: int, stride: int, parts: int, ordering: list[int] | None = None) -> None:
    # exactly what NxD's set_tensor_model_parallel_attributes sets
    t.tensor_model_parallel = True  # type: ignore[attr-defined]
    t.partition_dim = dim  # type: ignore[attr-defined]
    t.partition_stride = stride  # type: ignore[attr-defined]
    t.num_partitions = parts  # type: ignore[attr-defined]
    t.rank_ordering = ordering  # type: ignore[attr-defined]


def test_record_from_model_attributes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 4, bias=False))
    _mark(model[0].weight, 0, 3, 2)
    _mark(model[0].bias, 0, 3, 2)
    _mark(model[2].weight, 1, 1, 2)
    model.register_buffer("steps", torch.zeros(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = sh.record_from_model(model, 2, pp_stage=1, optimizer=opt)
    assert rec.tensors["0.weight"] == TensorSharding((12, 4), 0, 3, 2, 1)
    assert rec.tensors["0.bias"] == TensorSharding((12,), 0, 3, 2, 1)
    assert rec.tensors["1.weight"] == TensorSharding((6,), pp_stage=1)
    assert rec.tensors["2.weight"] == TensorSharding((4, 12), 1, 1, 2, 1)
    assert rec.tensors["steps"] == TensorSharding((3,), pp_stage=1)
    assert rec.optimizer_params == {1: ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight")}


def test_record_from_model_refuses_other_groups_and_kv_replication() -> None:
    class GQA(torch.nn.Module):
        def __init__(self, multiplier: int) -> None:
            super().__init__()
            self.kv_size_multiplier = multiplier
            self.output_sizes = [8, 4]
            self.weight_q = torch.nn.Parameter(torch.zeros(4, 3))
            self.weight_k = torch.nn.Parameter(torch.zeros(2, 3))
            for p in (self.weight_q, self.weight_k):
                _mark(p, 0, 1, 2)

    rec = sh.record_from_model(torch.nn.ModuleDict({"attn": GQA(2)}), 2)
    assert rec.tensors["attn.weight_q"].problem(1) is None
    with pytest.raises(ReshardError, match=r"'attn\.weight_k'.*kv_size_multiplier=2"):
        rec.tensors["attn.weight_k"].check("attn.weight_k", 1)
    lin = torch.nn.Linear(2, 4)
    _mark(lin.weight, 0, 1, 4)  # sharded over 4 ranks while TP is 2 (another group)
    with pytest.raises(ReshardError, match="over 4 ranks"):
        sh.record_from_model(lin, 2).tensors["weight"].check("weight", 1)


def test_record_from_model_fused_qkv_of_gqa_layer() -> None:
    class Fused(torch.nn.Module):
        def __init__(self, q: int, kv: int) -> None:
            super().__init__()
            self.kv_size_multiplier = 1
            self.output_sizes = [q, kv]
            self.weight_qkv = torch.nn.Parameter(torch.zeros((q + 2 * kv) // 2, 3))

    equal = sh.record_from_model(Fused(4, 4), 2).tensors["weight_qkv"]
    assert equal == TensorSharding((12, 3), 0, 3, 2)
    with pytest.raises(ReshardError, match="different sizes"):
        sh.record_from_model(Fused(8, 4), 2).tensors["weight_qkv"].check("weight_qkv", 1)


def test_record_from_spec() -> None:
    shapes = {"l.qkv.weight": (6, 4), "l.o.weight": (4, 2), "norm.weight": (4,)}
    rec = sh.record_from_spec({"*.qkv.weight": (0, 3), "*.o.weight": 1, "*": None}, shapes, 2, pp_stage=0)
    assert rec.tensors["l.qkv.weight"] == TensorSharding((12, 4), 0, 3, 2, 0)
    assert rec.tensors["l.o.weight"] == TensorSharding((4, 4), 1, 1, 2, 0)
    assert rec.tensors["norm.weight"] == TensorSharding((4,), pp_stage=0)
    with pytest.raises(ReshardError, match=r"'norm'.*TP=2"):
        sh.record_from_spec({"*.weight": 0, "l.*": 1}, {"norm": (4,), "norm.weight": (4,)}, 2)
    # TP=1: everything unmatched is whole anyway
    assert sh.record_from_spec({}, {"x": (3,)}, 1).tensors["x"] == TensorSharding((3,))


def test_record_from_a_describing_model_uses_each_parameters_own_partitions() -> None:
    lin = torch.nn.Linear(2, 4)
    _mark(lin.weight, 0, 2, 4)  # a model built for TP=4, used only to say how tensors are cut
    s = sh.record_from_model(lin, None).tensors["weight"]
    assert s == TensorSharding((16, 2), 0, 2, 4) and s.problem(4) is None
    assert sh.rebase(s, (6, 2), 2) == TensorSharding((12, 2), 0, 2, 2)


def _share(model: object, state: dict, **where: int) -> sh.ShardingShare:
    place = {"rank": 0, "tp_rank": 0, "replica_rank": 0, "tp": 1, "pp_stage": 0} | where
    return sh.share_for_save(model, state, None, **place)


def test_a_saves_shares_come_from_each_stages_first_replica_of_tp_rank_0_and_merge_on_rank_0() -> None:
    state = {"w": torch.ones(2, 3)}
    assert _share(None, state, tp_rank=1) is None and _share(None, state, replica_rank=1) is None
    stage0, stage1 = _share(None, state), _share(None, {"v": torch.ones(5)}, pp_stage=1)
    merged = sh.merge_shares([stage0, None, stage1])
    assert merged is not None and sorted(merged.tensors) == ["v", "w"]
    assert merged.tensors["v"].pp_stage == 1 and merged.tensors["w"].shape == (2, 3)


def test_a_share_that_cannot_be_read_is_a_message_and_the_merge_records_nothing(caplog) -> None:
    class Unreadable(torch.nn.Linear):
        def named_parameters(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
            raise RuntimeError("no parameters")

    model = Unreadable(2, 2)
    share = sh.share_for_save(model, {"weight": torch.ones(2, 2)}, None, rank=3, tp_rank=0, replica_rank=0, tp=2,
                              pp_stage=0)  # fmt: skip
    assert isinstance(share, str) and share.startswith("rank 3: ")
    with caplog.at_level("WARNING", logger="nxd_ckpt"):
        assert sh.merge_shares([share, _share(None, {"w": torch.ones(2)})]) is None
    assert "could not be recorded" in caplog.text and "sharding=" in caplog.text
