"""Load at another TP/PP/DP layout than the save, on real gloo ranks, bit-exact against the unsharded reference.

The model (nxd_ckpt.testing.tp_layers) has NxD-marked column-parallel layers with a fused gate/up weight
(stride 2), row-parallel layers and replicated LayerNorms; its optimizer state comes from two AdamW steps on
synthetic gradients that are the same global tensors at every layout. The reference is the same model and
optimizer built whole in one process: after the load, every rank's parameters and optimizer state must equal
the reference cut for its new coordinate, bit for bit.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from nxd_ckpt.load import zero1
from nxd_ckpt.parallel_state import current_topology
from nxd_ckpt.testing.counting import ReadCountingStorage
from nxd_ckpt.testing.multiprocess import run_on_ranks
from nxd_ckpt.testing.tp_layers import TPModel, nxd_local_weight
from nxd_ckpt.testing.zero1_adamw import Zero1AdamW

pytestmark = pytest.mark.usefixtures("xser_file_per_tensor")  # the byte counts look at individual tensor files

LR = 1e-2


def _groups(tp: int, pp: int) -> tuple[object, object, object]:
    """Initialise NxD's layout; torch process groups for this rank's TP and DP groups."""
    nxd.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    topo = current_topology()
    mine = {}
    for kind in ("tp", "dp"):
        for ranks in getattr(topo.groups, kind):
            g = dist.new_group(sorted(ranks))
            if dist.get_rank() in ranks:
                mine[kind] = g
    return topo, mine["tp"], mine["dp"]


def _local(full: torch.Tensor, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``full`` cut for this TP rank the way ``param`` is (NxD's attributes), or whole when replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return nxd_local_weight(full, param.partition_dim, tp, rank, param.partition_stride)


def _grad(name: str, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _reference(n_layers: int) -> tuple[TPModel, torch.optim.AdamW]:
    """The whole model and its optimizer after the same two steps (one process, TP=PP=1)."""
    model = TPModel(n_layers=n_layers, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _steps(model, opt, 1, 0)
    return model, opt


def _steps(model: TPModel, opt: torch.optim.Optimizer, tp: int, tp_rank: int) -> None:
    full = TPModel(n_layers=4, seed=0)  # shapes of every layer's global tensors (names are the same)
    shapes = {n: p.shape for n, p in full.named_parameters()}
    for _ in range(2):
        for name, p in model.named_parameters():
            p.grad = _local(_grad(name, shapes[name]), p, tp, tp_rank)
        opt.step()


def _build(topo, tp_group, dp_group, n_layers: int, kind: str, seed: int) -> tuple[TPModel, torch.optim.Optimizer]:
    model = TPModel(n_layers=n_layers, tp_group=tp_group, pp_rank=topo.pp_rank, pp_size=topo.pp_size, seed=seed)
    if kind == "zero1":
        opt: torch.optim.Optimizer = Zero1AdamW(model.parameters(), lr=LR, group=dp_group)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt


def _check(model: TPModel, opt: torch.optim.Optimizer, topo, kind: str, n_layers: int) -> None:
    """Bit-exact against the reference cut for this rank's new coordinate."""
    ref_model, ref_opt = _reference(n_layers)
    ref_params = dict(ref_model.named_parameters())
    index_of = {id(p): i for i, p in enumerate(ref_opt.param_groups[0]["params"])}
    ref_state = ref_opt.state_dict()["state"]
    state = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    assert names, "this stage holds no parameters"
    for i, (name, p) in enumerate(model.named_parameters()):
        want = _local(ref_params[name].detach(), p, topo.tp_size, topo.tp_rank)
        assert torch.equal(p.detach(), want), name
        ref = ref_state[index_of[id(ref_params[name])]]
        if kind == "zero1":
            entry = state["base_state"][i]
            assert list(state["shape_info"][i]) == list(p.shape)
            assert torch.equal(state["sharded_master_weights"][i], zero1.shard_tensor(want, topo.dp_size, topo.dp_rank))
        else:
            entry = state["state"][i]
        assert float(entry["step"]) == float(ref["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            local = _local(ref[key], p, topo.tp_size, topo.tp_rank)
            if kind == "zero1":
                local = zero1.shard_tensor(local, topo.dp_size, topo.dp_rank)
            assert torch.equal(entry[key], local), f"{name} {key}"


def _save_and_load(root: str, src: tuple[int, int], dst: tuple[int, int], encoding: str, kind: str, n_layers: int) -> None:
    topo, tp_group, dp_group = _groups(*src)
    model, opt = _build(topo, tp_group, dp_group, n_layers, kind, seed=0)
    _steps(model, opt, topo.tp_size, topo.tp_rank)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(ckpt, "t", model=model, optimizer=opt, zero1_optimizer=kind == "zero1", use_xser=encoding == "xser")
    nxd.destroy_model_parallel()
    topo, tp_group, dp_group = _groups(*dst)
    model2, opt2 = _build(topo, tp_group, dp_group, n_layers, kind, seed=7)
    if kind == "zero1":
        _steps(model2, opt2, topo.tp_size, topo.tp_rank)  # state to overwrite (ZeRO-1 loads into existing shards)
    nxd.load_checkpoint(ckpt, "t", model=model2, optimizer=opt2)
    _check(model2, opt2, topo, kind, n_layers)


CASES = [
    # (world, src (tp, pp), dst (tp, pp), encoding, optimizer)
    pytest.param(2, (2, 1), (1, 1), "plain", "adamw", id="tp2-to-tp1-plain-adamw"),
    pytest.param(2, (2, 1), (1, 1), "xser", "adamw", id="tp2-to-tp1-xser-adamw"),
    pytest.param(2, (1, 1), (2, 1), "plain", "zero1", id="tp1dp2-to-tp2-plain-zero1"),
    pytest.param(2, (1, 1), (2, 1), "xser", "adamw", id="tp1-to-tp2-xser-adamw"),
    pytest.param(4, (4, 1), (2, 1), "xser", "zero1", id="tp4-to-tp2dp2-xser-zero1"),
    pytest.param(4, (4, 1), (2, 1), "plain", "adamw", id="tp4-to-tp2dp2-plain-adamw"),
    pytest.param(2, (1, 2), (1, 1), "plain", "adamw", id="pp2-to-pp1-plain-adamw"),
    pytest.param(2, (1, 1), (1, 2), "xser", "zero1", id="pp1dp2-to-pp2-xser-zero1"),
    pytest.param(4, (2, 2), (1, 1), "plain", "zero1", id="tp2pp2-to-dp4-plain-zero1"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,src,dst,encoding,kind", CASES)
def test_load_at_another_layout_is_bit_exact(tmp_path, world, src, dst, encoding, kind):
    run_on_ranks(
        _save_and_load,
        world,
        {"root": str(tmp_path), "src": src, "dst": dst, "encoding": encoding, "kind": kind, "n_layers": 2},
    )
