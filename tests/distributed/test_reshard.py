"""Load at another TP/PP/DP layout than the save, on real gloo ranks, bit-exact against the unsharded reference.

The model (harness.tp_layers) has NxD-marked column-parallel layers with a fused gate/up weight
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
from harness.multiprocess import run_on_ranks
from harness.tp_layers import TPModel, nxd_local_weight
from harness.zero1_adamw import Zero1AdamW
from nxd_ckpt.load import zero1
from nxd_ckpt.parallel_state import current_topology
from nxd_ckpt.testing.counting import ReadCountingStorage

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


def _save_and_load(
    root: str, src: tuple[int, int], dst: tuple[int, int], encoding: str, kind: str, n_layers: int
) -> None:
    topo, tp_group, dp_group = _groups(*src)
    model, opt = _build(topo, tp_group, dp_group, n_layers, kind, seed=0)
    _steps(model, opt, topo.tp_size, topo.tp_rank)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(
        ckpt, "t", model=model, optimizer=opt, zero1_optimizer=kind == "zero1", use_xser=encoding == "xser"
    )
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


# ------------------------------------------------------------------------------------------- bytes read


def _count_bytes(root: str, encoding: str) -> None:
    """TP=1 (DP=2) saves; TP=2 loads: each rank reads its half of every sharded tensor and the replicated
    ones whole, plus the files' structure, never the other rank's half."""
    d, hidden = 128, 128  # large enough that tensor data, not zip headers, dominates
    topo, tp_group, _dp_group = _groups(1, 1)
    model = TPModel(d=d, hidden=hidden, n_layers=2, tp_group=tp_group, seed=0)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(ckpt, "t", model=model, use_xser=encoding == "xser")
    nxd.destroy_model_parallel()
    topo, tp_group, _ = _groups(2, 1)
    target = TPModel(d=d, hidden=hidden, n_layers=2, tp_group=tp_group, seed=3)
    needed = sum(t.numel() * t.element_size() for t in target.state_dict().values())
    saved = 0
    for dirpath, _, files in os.walk(os.path.join(ckpt, "t", "model")):
        saved += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    storage = ReadCountingStorage(ckpt)
    nxd.load_checkpoint(storage, "t", model=target, verify=False)
    read = sum(n for path, n in storage.bytes_read.items() if path.startswith("t/model/"))
    reference = TPModel(d=d, hidden=hidden, n_layers=2, seed=0)
    for name, p in target.named_parameters():
        assert torch.equal(p.detach(), _local(reference.state_dict()[name], p, 2, topo.tp_rank)), name
    # structure (zip directories, pickles, xser headers) is a few KiB per file; the data is what this rank holds
    files_touched = len([p for p in storage.bytes_read if p.startswith("t/model/")])
    assert needed <= read <= needed + 8192 * files_touched, (read, needed, files_touched)
    assert read < 0.6 * saved, (read, saved)  # about half of what was saved, not all of it


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encoding", ["plain", "xser"])
def test_resharded_load_reads_only_the_bytes_the_rank_needs(tmp_path, encoding):
    run_on_ranks(_count_bytes, 2, {"root": str(tmp_path), "encoding": encoding})


# ------------------------------------------------------------------------------------------- refusals, specs


class _GQA(torch.nn.Module):
    """NxD's GQAQKVColumnParallelLinear as far as sharding goes: K/V heads repeated over the TP ranks."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        from harness.tp_layers import set_nxd_attributes

        self.kv_size_multiplier = 2
        self.output_sizes = [4, 1]
        self.weight_k = torch.nn.Parameter(torch.ones(2 // tp, 4))
        set_nxd_attributes(self.weight_k, 0, 1, tp)


def _refusals_and_specs(root: str) -> None:
    _, tp_group, _ = _groups(2, 1)
    model = TPModel(n_layers=2, tp_group=tp_group, seed=0)
    model.attn = _GQA(2)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(ckpt, "gqa", model=model)
    # an NxD-like checkpoint: plain state dicts, no sharding recorded
    nxd.save_checkpoint(
        ckpt, "nxd", model={k: v for k, v in TPModel(n_layers=2, tp_group=tp_group, seed=0).state_dict().items()}
    )
    nxd.destroy_model_parallel()
    _topo, tp_group, _ = _groups(1, 1)
    target = TPModel(n_layers=2, tp_group=tp_group, seed=5)
    target.attn = _GQA(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        nxd.ReshardError, match=r"'attn\.weight_k' cannot be re-sharded from TP=2 to TP=1: .*kv_size_multiplier=2"
    ):
        nxd.load_checkpoint(ckpt, "gqa", model=target)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the load was refused"
    plain = TPModel(n_layers=2, tp_group=tp_group, seed=5)
    with pytest.raises(
        nxd.LayoutMismatchError, match=r"saved with TP=2 PP=1 but this job runs TP=1.*records no sharding"
    ):
        nxd.load_checkpoint(ckpt, "nxd", model=plain)
    with pytest.raises(nxd.ReshardError, match=r"no pattern matching tensor 'layers\.0\.norm\.weight'"):
        nxd.load_checkpoint(ckpt, "nxd", model=plain, sharding={"*.gate_up.*": (0, 2), "*.down.weight": 1})
    reference = TPModel(n_layers=2, seed=0).state_dict()
    spec = {"*.gate_up.*": (0, 2), "*.down.weight": 1, "*": None}
    for sharding in (spec, TPModel(n_layers=2, seed=1)):  # name patterns, or a model carrying NxD's attributes
        fresh = TPModel(n_layers=2, tp_group=tp_group, seed=5)
        nxd.load_checkpoint(ckpt, "nxd", model=fresh, sharding=sharding)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, reference[k]), k


@pytest.mark.timeout(300)
def test_unsupported_layouts_are_refused_before_loading_and_specs_describe_nxd_checkpoints(tmp_path):
    run_on_ranks(_refusals_and_specs, 2, {"root": str(tmp_path)})


# ------------------------------------------------------------------------------------------- training resume


GLOBAL_BATCH = 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)


def _train(model: TPModel, opt: torch.optim.Optimizer, steps: range, dp_group, dp: int, dp_rank: int) -> list[float]:
    """Data-parallel steps over a fixed global batch (each DP rank its slice); returns the global mean losses."""
    losses = []
    n = GLOBAL_BATCH // dp
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(
            model(x[dp_rank * n : (dp_rank + 1) * n]), y[dp_rank * n : (dp_rank + 1) * n]
        )
        opt.zero_grad()
        loss.backward()
        if dp > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
        opt.step()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total, group=dp_group)
        losses.append(float(total) / dp)
    return losses


def _train_tp2_resume_tp1(root: str) -> None:
    topo, tp_group, dp_group = _groups(2, 1)
    model = TPModel(n_layers=2, tp_group=tp_group, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(0, 3), dp_group, 1, 0)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(ckpt, "step_3", model=model, optimizer=opt, use_xser=True)
    # the state at the moment of saving, merged whole by NxD's rule (independent of nxd_ckpt's arithmetic)
    from harness.tp_layers import nxd_full_weight

    def whole(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if not getattr(p, "tensor_model_parallel", False):
            return t.clone()
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        return nxd_full_weight(parts, p.partition_dim, p.partition_stride)

    params = list(model.named_parameters())
    at_save = {n: whole(p.detach(), p) for n, p in params}
    moments = {(n, k): whole(opt.state[p][k], p) for n, p in params for k in ("exp_avg", "exp_avg_sq")}
    reference = _train(model, opt, range(3, 7), dp_group, 1, 0)
    nxd.destroy_model_parallel()

    topo, tp_group, dp_group = _groups(1, 1)  # TP=1, DP=2
    model2 = TPModel(n_layers=2, tp_group=tp_group, seed=42)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
    nxd.load_checkpoint(ckpt, model=model2, optimizer=opt2)
    for n, p in model2.named_parameters():
        assert torch.equal(p.detach(), at_save[n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt2.state[p][k], moments[(n, k)]), (n, k)
    resumed = _train(model2, opt2, range(3, 7), dp_group, topo.dp_size, topo.dp_rank)
    assert resumed == pytest.approx(reference, rel=1e-5, abs=1e-7)


@pytest.mark.timeout(300)
def test_training_saved_at_tp2_resumes_at_tp1(tmp_path):
    run_on_ranks(_train_tp2_resume_tp1, 2, {"root": str(tmp_path)})


# ------------------------------------------------------------------------------------------- converted inputs


def _full_zero1_to_other_tp(root: str) -> None:
    """ZeRO-1 state merged into full files by convert-zero1 keeps the sharding record and re-shards too."""
    from nxd_ckpt.tools.convert_zero1 import convert_zero1

    topo, tp_group, dp_group = _groups(2, 1)
    model, opt = _build(topo, tp_group, dp_group, 2, "zero1", seed=0)
    _steps(model, opt, topo.tp_size, topo.tp_rank)
    nxd.save_checkpoint(os.path.join(root, "ckpt"), "t", model=model, optimizer=opt, zero1_optimizer=True)
    if dist.get_rank() == 0:
        convert_zero1(os.path.join(root, "ckpt", "t"), os.path.join(root, "full", "t"), convert_to_full=True)
    dist.barrier()
    nxd.destroy_model_parallel()
    topo, tp_group, dp_group = _groups(1, 1)
    model2, opt2 = _build(topo, tp_group, dp_group, 2, "zero1", seed=7)
    nxd.load_checkpoint(os.path.join(root, "full"), "t", model=model2, optimizer=opt2)
    _check(model2, opt2, topo, "zero1", 2)


@pytest.mark.timeout(300)
def test_full_zero1_files_load_at_another_tp(tmp_path):
    run_on_ranks(_full_zero1_to_other_tp, 2, {"root": str(tmp_path)})
