"""Export, import and offline reshard across TP/PP layouts, checked bit for bit against the unsharded model.

A TP=2 PP=2 checkpoint is saved by 4 real gloo ranks, each holding its shard of one reference model (cut here
the way NxD's ``create_local_weight`` cuts, independently of nxd_ckpt's sharding code): column-parallel,
row-parallel, a fused (stride 3) projection, a vocab-parallel embedding, replicated norms, bf16 and fp32. Outputs
are read back with third-party readers: the ``safetensors`` package and stock ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks, run_with_ranks
from nxd_ckpt.cli import main
from nxd_ckpt.errors import CheckpointError, IntegrityError

# name -> (shape, partition dim or None, stride, dtype, pp stage)
SPEC = {
    "embed.weight": ((12, 8), 0, 1, torch.float32, 0),
    "layers.0.qkv.weight": ((12, 8), 0, 3, torch.float32, 0),
    "layers.0.qkv.bias": ((12,), 0, 3, torch.float32, 0),
    "layers.0.out.weight": ((8, 12), 1, 1, torch.bfloat16, 0),
    "layers.0.norm.weight": ((8,), None, 1, torch.float32, 0),
    "layers.1.qkv.weight": ((12, 8), 0, 3, torch.float32, 1),
    "layers.1.qkv.bias": ((12,), 0, 3, torch.float32, 1),
    "layers.1.out.weight": ((8, 12), 1, 1, torch.bfloat16, 1),
    "layers.1.norm.weight": ((8,), None, 1, torch.float32, 1),
    "head.weight": ((4, 8), 0, 1, torch.bfloat16, 1),
}
SPEC_FILE = {"*.qkv.*": [0, 3], "*.out.weight": 1, "embed.weight": 0, "head.weight": 0, "*": None}
STAGES = {"embed.*": 0, "layers.0.*": 0, "*": 1}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, _, _, dtype, _) in SPEC.items()}


def nxd_local(full: torch.Tensor, dim: int | None, stride: int, tp: int, rank: int) -> torch.Tensor:
    """NxD's ``create_local_weight``: split into tp*stride chunks along dim, rank takes chunks rank::tp."""
    if dim is None:
        return full.clone()
    per_rank = full.shape[dim] // tp
    chunks = torch.split(full, per_rank // stride, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim).contiguous()


class StageModel(nn.Module):
    """One PP stage's share of the reference model on one TP rank, parameters marked as NxD marks them."""

    def __init__(self, tp: int, tp_rank: int, stage: int | None, full: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names: list[str] = []
        for name, (_, dim, stride, _, pp) in SPEC.items():
            if stage is not None and pp != stage:
                continue
            param = nn.Parameter(nxd_local(full[name], dim, stride, tp, tp_rank))
            if dim is not None and tp > 1:
                param.tensor_model_parallel = True
                param.partition_dim = dim
                param.partition_stride = stride
                param.num_partitions = tp
            self._place(name, param)
            self.names.append(name)

    def _place(self, name: str, param: nn.Parameter) -> None:
        owner: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, param)


def _save_tp2_pp2(out: str) -> None:
    nxd.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    tp_rank, pp_rank = rank % 2, rank // 2
    model = StageModel(2, tp_rank, pp_rank, reference())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nxd.save_checkpoint(out, "plain", model=model, user_content={"step": 7})
    nxd.save_checkpoint(out, "xser", model=model, optimizer=opt, use_xser=True)
    dist.barrier()


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory) -> Path:
    """ckpt/plain (model + user content), ckpt/xser (model + optimizer), nxd/plain: as NxD writes (no metadata)."""
    d = tmp_path_factory.mktemp("tp2pp2")
    run_on_ranks(_save_tp2_pp2, 4, {"out": str(d / "ckpt")})
    nxd_tag = d / "nxd" / "plain"
    shutil.copytree(d / "ckpt" / "plain", nxd_tag)
    os.remove(nxd_tag / "nxd_ckpt.json")
    shutil.rmtree(nxd_tag / "nxd_ckpt")
    return d


@pytest.fixture
def cli(capsys):
    def call(*args: str, check: int = 0) -> tuple[str, str]:
        status = main(list(args))
        out, err = capsys.readouterr()
        assert status == check, f"exit {status}\nstdout:\n{out}\nstderr:\n{err}"
        return out, err

    return call


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or set(got) == set(want), (sorted(got), sorted(want))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)) if tensor.numel() else True, name


def read_set(directory: Path) -> dict[str, torch.Tensor]:
    """A safetensors set through the safetensors package, file by file as the index lists them."""
    from safetensors.torch import load_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(str(directory / file))
        assert {n for n, f in index["weight_map"].items() if f == file} == set(part)
        out.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("tag", ["plain", "xser"])
def test_export_tp2_pp2_safetensors_set_equals_the_unsharded_model(tp2pp2, tmp_path, cli, tag):
    out = tmp_path / "hf"
    stdout, _ = cli("export", str(tp2pp2 / "ckpt"), "--tag", tag, "--out", str(out), "--max-shard-size", "400B")
    assert stdout.startswith(f"wrote {out}: {len(SPEC)} tensors")
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 2  # several files at 400 bytes each
    assert files[0] == f"model-00001-of-{len(files) - 1:05d}.safetensors"
    assert_bit_equal(read_set(out), reference())


def test_export_of_an_nxd_written_tag_needs_and_uses_a_sharding_spec(tp2pp2, tmp_path, cli):
    out = tmp_path / "model.safetensors"
    err = cli("export", str(tp2pp2 / "nxd"), "--tag", "plain", "--out", str(out), check=1)[1]
    assert "without a sharding record" in err and "--sharding-spec" in err
    assert not out.exists()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC_FILE))
    cli("export", str(tp2pp2 / "nxd"), "--tag", "plain", "--out", str(out), "--sharding-spec", str(spec))
    from safetensors.torch import load_file

    assert_bit_equal(load_file(str(out)), reference())
    # a spec that misses a tensor names it
    spec.write_text(json.dumps({"*.qkv.*": [0, 3]}))
    err = cli("export", str(tp2pp2 / "nxd"), "--tag", "plain", "--out", str(tmp_path / "x"), "--sharding-spec",
              str(spec), check=1)[1]  # fmt: skip
    assert "no pattern matching tensor" in err


def test_export_renames_refuses_clashes_and_replaces_only_with_force(tp2pp2, tmp_path, cli):
    out = tmp_path / "renamed"
    rename = tmp_path / "rename.json"
    rename.write_text(
        json.dumps({"exact": {"head.weight": "lm_head.weight"}, "patterns": [["^layers\\.", "model.layers."]]})
    )
    cli("export", str(tp2pp2 / "ckpt"), "--tag", "plain", "--out", str(out), "--rename", str(rename))
    got = read_set(out)
    ref = reference()
    assert torch.equal(got["lm_head.weight"], ref["head.weight"])
    assert torch.equal(got["model.layers.1.qkv.bias"], ref["layers.1.qkv.bias"])
    assert "already exists" in cli("export", str(tp2pp2 / "ckpt"), "--tag", "plain", "--out", str(out), check=1)[1]
    err = cli("export", str(tp2pp2 / "ckpt"), "--tag", "plain", "--out", str(tmp_path / "clash"),
              "--rename-pattern", r"\.(weight|bias)$=.p", check=1)[1]  # fmt: skip
    assert "the same name" in err and not (tmp_path / "clash").exists()
    cli("export", str(tp2pp2 / "ckpt"), "--tag", "xser", "--out", str(out), "--force")
    assert_bit_equal(read_set(out), reference())


def test_export_reads_are_verified(tp2pp2, tmp_path, cli):
    damaged = tmp_path / "ckpt"
    shutil.copytree(tp2pp2 / "ckpt", damaged)
    victim = damaged / "plain" / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt"
    data = bytearray(victim.read_bytes())
    data[-200] ^= 0xFF
    victim.write_bytes(bytes(data))
    err = cli("export", str(damaged), "--tag", "plain", "--out", str(tmp_path / "out"), check=1)[1]
    assert "dp_rank_00_tp_rank_01_pp_rank_01.pt" in err
    assert not (tmp_path / "out").exists()
    from nxd_ckpt.tools.export import export

    with pytest.raises(IntegrityError):
        export(nxd.open_checkpoint(damaged, "plain"), tmp_path / "out2")


# ---------------------------------------------------------------------------------------------- DCP


def test_export_dcp_loads_with_stock_dcp_into_a_full_state_dict(tp2pp2, tmp_path, cli):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    cli("export", str(tp2pp2 / "ckpt"), "--tag", "xser", "--out", str(out), "--format", "dcp")
    ref = reference()
    state = {n: torch.zeros_like(t) for n, t in ref.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    assert_bit_equal(state, ref)


@run_with_ranks(2)
def test_export_dcp_loads_into_dtensors_on_another_world_size(tp2pp2, tmp_path):
    """Saved by 4 ranks at TP=2 PP=2, exported, then loaded by 2 ranks into DTensors sharded over a 2-device mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    out = tmp_path / "dcp"
    if rank == 0:
        from nxd_ckpt.tools.export import export

        export(nxd.open_checkpoint(tp2pp2 / "ckpt", "plain"), out, format="dcp")
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,))
    ref = reference()
    placements = {n: [Shard(0)] if t.dim() and t.shape[0] % 2 == 0 else [Replicate()] for n, t in ref.items()}
    placements["layers.0.out.weight"] = [Shard(1)]
    state = {n: distribute_tensor(torch.zeros_like(t), mesh, placements[n]) for n, t in ref.items()}
    dcp.load(state, checkpoint_id=str(out))
    for name, want in ref.items():
        got = state[name]
        assert torch.equal(got.full_tensor().view(torch.uint8), want.view(torch.uint8)), name
        if isinstance(placements[name][0], Shard):
            dim = placements[name][0].dim
            expected_local = want.chunk(2, dim=dim)[rank]
            assert torch.equal(got.to_local().view(torch.uint8), expected_local.view(torch.uint8)), name
    dist.barrier()


# ---------------------------------------------------------------------------------------------- reshard


def _load_into(ckpt_dir: str, tag: str, tp: int, pp: int) -> None:
    """On tp*pp ranks: load the tag into this rank's stage model and compare with NxD's cut of the reference."""
    nxd.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    rank = dist.get_rank()
    tp_rank, pp_rank = rank % tp, rank // tp
    full = reference()
    model = StageModel(tp, tp_rank, pp_rank if pp > 1 else None, {n: torch.zeros_like(t) for n, t in full.items()})
    nxd.load_checkpoint(ckpt_dir, tag, model=model)
    for name, param in model.named_parameters():
        dim, stride = SPEC[name][1], SPEC[name][2]
        want = nxd_local(full[name], dim, stride, tp, tp_rank)
        assert torch.equal(param.detach().view(torch.uint8), want.view(torch.uint8)), (rank, name)


def test_reshard_to_tp1_pp1_and_tp4(tp2pp2, tmp_path, cli):
    err = cli("reshard", str(tp2pp2 / "ckpt"), "--tag", "xser", "--tp", "1", "--pp", "1", "--out", str(tmp_path),
              check=1)[1]  # fmt: skip
    assert "optimizer state" in err and "--model-only" in err and not (tmp_path / "xser").exists()
    out = tmp_path / "tp1"
    stdout, _ = cli("reshard", str(tp2pp2 / "ckpt"), "--tag", "plain", "--tp", "1", "--pp", "1", "--out", str(out))
    assert "re-sharded DP=1 TP=2 PP=2 -> DP=any TP=1 PP=1: 10 tensors" in stdout
    assert (out / "plain" / "done").exists()
    cli("verify", str(out), "--tag", "plain")
    model = StageModel(1, 0, None, {n: torch.zeros_like(t) for n, t in reference().items()})
    assert nxd.load_checkpoint(str(out), "plain", model=model) == {"step": 7}
    assert_bit_equal(dict(model.state_dict()), reference())
    # TP=4 (stride-3 tensors of 12 rows: 4 x 3 chunks of 1), then back through export
    out4 = tmp_path / "tp4"
    cli("reshard", str(out), "--tag", "plain", "--tp", "4", "--out", str(out4), "--out-tag", "t4")
    sd = torch.load(out4 / "t4" / "model" / "dp_rank_00_tp_rank_03_pp_rank_00.pt")
    assert torch.equal(sd["layers.1.qkv.weight"], nxd_local(reference()["layers.1.qkv.weight"], 0, 3, 4, 3))
    assert torch.equal(sd["layers.0.out.weight"], nxd_local(reference()["layers.0.out.weight"], 1, 1, 4, 3))
    cli("export", str(out4), "--tag", "t4", "--out", str(tmp_path / "hf4"))
    assert_bit_equal(read_set(tmp_path / "hf4"), reference())
    assert "is the input tag" in cli("reshard", str(out), "--tag", "plain", "--tp", "2", "--out", str(out), check=1)[1]
    err = cli("reshard", str(tp2pp2 / "ckpt"), "--tag", "plain", "--tp", "1", "--out", str(out), check=1)[1]
    assert "already exists" in err


def test_reshard_refuses_what_it_cannot_do(tp2pp2, tmp_path, cli):
    ckpt = str(tp2pp2 / "ckpt")
    err = cli("reshard", ckpt, "--tag", "plain", "--tp", "3", "--out", str(tmp_path), check=1)[1]
    assert "cannot be re-sharded to TP=3" in err and not (tmp_path / "plain").exists()
    err = cli("reshard", ckpt, "--tag", "plain", "--tp", "1", "--pp", "3", "--out", str(tmp_path), check=1)[1]
    assert "stage map" in err
    assert "give the target layout" in cli("reshard", ckpt, "--tag", "plain", "--out", str(tmp_path), check=1)[1]
    err = cli("reshard", ckpt, "--tag", "plain", "--dp", "2", "--out", str(tmp_path), check=1)[1]
    assert "nothing in it depends on DP" in err


@run_with_ranks(2)
def test_reshard_pp2_to_pp1_tp2_loads_into_a_tp2_model(tp2pp2, tmp_path):
    if dist.get_rank() == 0:
        from nxd_ckpt.tools.reshard import reshard

        reshard(nxd.open_checkpoint(tp2pp2 / "ckpt", "plain"), tmp_path / "out", pp=1)
    dist.barrier()
    _load_into(str(tmp_path / "out"), "plain", tp=2, pp=1)


# ---------------------------------------------------------------------------------------------- import


@run_with_ranks(2)
def test_import_load_export_round_trip(tmp_path):
    """safetensors -> import at TP=2 (xser) -> load_checkpoint into a TP=2 model -> save -> export: bit-exact."""
    from safetensors.torch import save_file

    from nxd_ckpt.tools.export import export
    from nxd_ckpt.tools.importer import import_weights

    rank = dist.get_rank()
    ref = reference()
    if rank == 0:
        save_file(ref, str(tmp_path / "model.safetensors"))
        import_weights(tmp_path / "model.safetensors", tmp_path / "ckpt", "hf", tp=2, sharding=SPEC_FILE, use_xser=True)
    dist.barrier()
    _load_into(str(tmp_path / "ckpt"), "hf", tp=2, pp=1)
    model = StageModel(2, rank, None, {n: torch.zeros_like(t) for n, t in ref.items()})
    nxd.load_checkpoint(str(tmp_path / "ckpt"), "hf", model=model)
    nxd.save_checkpoint(str(tmp_path / "ckpt"), "resaved", model=model)
    if rank == 0:
        for tag in ("hf", "resaved"):
            export(nxd.open_checkpoint(tmp_path / "ckpt", tag), tmp_path / f"out-{tag}.safetensors")
            from safetensors.torch import load_file

            assert_bit_equal(load_file(str(tmp_path / f"out-{tag}.safetensors")), ref)
    dist.barrier()


def test_import_of_a_dcp_checkpoint_and_of_a_set_at_pp2(tp2pp2, tmp_path, cli):
    cli("export", str(tp2pp2 / "ckpt"), "--tag", "plain", "--out", str(tmp_path / "dcp"), "--format", "dcp")
    cli("export", str(tp2pp2 / "ckpt"), "--tag", "plain", "--out", str(tmp_path / "hf"), "--max-shard-size", "1KB")
    spec, stages = tmp_path / "spec.json", tmp_path / "stages.json"
    spec.write_text(json.dumps(SPEC_FILE))
    stages.write_text(json.dumps(STAGES))
    stdout, _ = cli("import", str(tmp_path / "dcp"), "--out", str(tmp_path / "ckpt"), "--tag", "from_dcp", "--tp", "2",
                    "--sharding-spec", str(spec))  # fmt: skip
    assert "from dcp" in stdout
    cli("import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--tag", "from_hf", "--tp", "2", "--pp", "2",
        "--sharding-spec", str(spec), "--stage-map", str(stages))  # fmt: skip
    for tag in ("from_dcp", "from_hf"):
        cli("verify", str(tmp_path / "ckpt"), "--tag", tag)
        cli("export", str(tmp_path / "ckpt"), "--tag", tag, "--out", str(tmp_path / f"{tag}.safetensors"))
        from safetensors.torch import load_file

        assert_bit_equal(load_file(str(tmp_path / f"{tag}.safetensors")), reference())
    # the PP=2 tag holds exactly the saved stages' files, each TP shard as NxD cuts it
    sd = torch.load(tmp_path / "ckpt" / "from_hf" / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt")
    assert set(sd) == {n for n, s in SPEC.items() if s[4] == 1}
    assert torch.equal(sd["layers.1.qkv.bias"], nxd_local(reference()["layers.1.qkv.bias"], 0, 3, 2, 1))
    # errors: no spec at TP>1, an existing tag, not a safetensors file
    err = cli("import", str(tmp_path / "dcp"), "--out", str(tmp_path / "ckpt"), "--tag", "x", "--tp", "2", check=1)[1]
    assert "--sharding-spec" in err and not (tmp_path / "ckpt" / "x").exists()
    err = cli("import", str(tmp_path / "dcp"), "--out", str(tmp_path / "ckpt"), "--tag", "from_hf", check=1)[1]
    assert "already holds a checkpoint" in err
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    err = cli("import", str(tmp_path / "junk.safetensors"), "--out", str(tmp_path / "ckpt"), "--tag", "j", check=1)[1]
    assert "invalid safetensors header" in err


def test_dcp_metadata_with_foreign_classes_is_refused(tmp_path):
    import pickle

    from nxd_ckpt.errors import UnsafeCheckpointError
    from nxd_ckpt.tools.dcp_io import DcpSource

    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(CheckpointError("x")))
    with pytest.raises(UnsafeCheckpointError, match="nxd_ckpt.errors.CheckpointError"):
        DcpSource(str(tmp_path / "dcp"))


def test_model_source_refuses_a_tag_without_model(tmp_path):
    nxd.save_checkpoint(str(tmp_path), "s", user_content={"a": 1})
    from nxd_ckpt.tools.model_source import CheckpointModel

    with pytest.raises(CheckpointError, match="holds no model state"):
        CheckpointModel(nxd.open_checkpoint(tmp_path, "s"))


# ---------------------------------------------------------------------------------------------- DP and DCP optim


def test_reshard_dp_is_the_zero1_conversion(tmp_path, cli):
    from test_convert_zero1 import TAG, merged_from_files, read_optim, write_checkpoint

    fulls = write_checkpoint(str(tmp_path / "in"), dp=2, tp=2, use_xser=False)
    stdout, _ = cli("reshard", str(tmp_path / "in"), "--tag", TAG, "--dp", "3", "--out", str(tmp_path / "out"))
    assert "DP=2 TP=2 PP=1 -> DP=3 TP=2 PP=1" in stdout
    cli("verify", str(tmp_path / "out"), "--tag", TAG)
    for t in range(2):
        shards = [read_optim(str(tmp_path / "out"), f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt") for d in range(3)]
        merged = merged_from_files(shards)
        for i, slots in fulls[t]["base_state"].items():
            assert torch.equal(merged["base_state"][i]["exp_avg"], slots["exp_avg"])
    err = cli("reshard", str(tmp_path / "in"), "--tag", TAG, "--tp", "1", "--out", str(tmp_path / "o2"), check=1)[1]
    assert "optimizer state" in err and "--model-only" in err


def test_zero1_in_dcp_format_needs_its_parameter_order(tmp_path, cli):
    """A tag whose optim/ is a DCP checkpoint (NxD's use_zero1_dcp=True): what is missing is said, not mistaken."""
    import torch.distributed.checkpoint as dcp
    from test_convert_zero1 import TAG, write_checkpoint

    write_checkpoint(str(tmp_path / "in"), dp=1, tp=1, use_xser=False, metadata=False)
    optim = tmp_path / "in" / TAG / "optim"
    shutil.rmtree(optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"base_state.w.exp_avg": torch.ones(4, 4)}, checkpoint_id=str(optim), no_dist=True)
    err = cli("reshard", str(tmp_path / "in"), "--tag", TAG, "--dp", "2", "--out", str(tmp_path / "out"), check=1)[1]
    assert "optimizer's parameter index" in err and "--param-order" in err
    err = cli("reshard", str(tmp_path / "in"), "--tag", TAG, "--tp", "2", "--out", str(tmp_path / "out"), check=1)[1]
    assert "use_zero1_dcp" in err and "--model-only" in err and not (tmp_path / "out" / TAG).exists()
    err = cli("convert-zero1", "--input_dir", str(tmp_path / "in" / TAG), "--output_dir", str(tmp_path / "o" / TAG),
              "--convert_to_full", check=1)[1]  # fmt: skip
    assert "use_zero1_dcp" in err
    # the model alone re-shards (the model files are NxD's usual ones)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"w": 0, "*": None}))
    stdout, _ = cli("reshard", str(tmp_path / "in"), "--tag", TAG, "--tp", "2", "--model-only", "--sharding-spec",
                    str(spec), "--out", str(tmp_path / "out"))  # fmt: skip
    assert "model only: the optimizer state was not carried" in stdout
    assert sorted(os.listdir(tmp_path / "out" / TAG / "model")) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "dp_rank_00_tp_rank_01_pp_rank_00.pt",
    ]


# -------------------------------------------------------------------------- NxD's ZeRO-1 through DCP, as NxD writes it


def _nxd_tensor_to_sharded_tensor(tensor, param_shape, dp_rank, dp_size, dp_group):
    """NxD's ``zero_dcp_utils._tensor_to_sharded_tensor`` (release 2.29), its getters replaced by arguments."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    if tensor.dim() == 0:
        return tensor
    padded_shape = (tensor.shape[0] * dp_size, *tensor.shape[1:])
    if dp_rank == dp_size - 1 and padded_shape[0] != param_shape[0]:
        tensor = tensor[: tensor.shape[0] - padded_shape[0] + param_shape[0]].clone()
    offsets = [0] * len(padded_shape)
    offsets[0] = (padded_shape[0] // dp_size) * dp_rank
    local_shards = [Shard.from_tensor_and_offsets(tensor, offsets, dp_rank)]
    chunk_sizes = []
    for i in range(dp_size):
        if i == dp_size - 1 and padded_shape[0] != param_shape[0]:
            chunk_sizes.append((tensor.shape[0] - (padded_shape[0] - param_shape[0]), *tensor.shape[1:]))
        else:
            chunk_sizes.append(tensor.shape)
    import itertools

    dim0_offsets = [0, *list(itertools.accumulate([c[0] for c in chunk_sizes]))[:-1]]
    rest = [0] * (len(chunk_sizes[0]) - 1)
    chunk_offsets = [[d0, *rest] for d0 in dim0_offsets]
    placements = [f"rank:{r}/cpu" for r in range(len(chunk_sizes))]
    shards_metadata = [
        ShardMetadata(offset, list(size), placement)
        for offset, size, placement in zip(chunk_offsets, chunk_sizes, placements, strict=True)
    ]
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size(param_shape),
        tensor_properties=TensorProperties(
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=tensor.is_pinned(),
        ),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=dp_group
    )


def _nxd_wrap_optim_state_dict(state_dict, pid_to_pname, pid_to_param, tp_rank, tp_size, pp_rank, pp_size, dp):
    """NxD's ``zero_dcp_utils._wrap_optim_state_dict`` (release 2.29, dedup=False)."""
    import copy

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    pname_to_pid = {v: k for k, v in pid_to_pname.items()}
    new_state_dict = copy.copy(state_dict)
    new_state_dict["base_state"] = {pid_to_pname[k]: v for k, v in state_dict["base_state"].items()}
    shape_info = new_state_dict["shape_info"]
    new_state_dict, mappings = flatten_state_dict(new_state_dict)
    for k, v in new_state_dict.items():
        if isinstance(v, torch.Tensor):
            pname = mappings[k][1]
            pid = pname_to_pid[pname]
            new_state_dict[k] = _nxd_tensor_to_sharded_tensor(v, shape_info[pid], *dp)
            if v.dim() > 0:
                fqn = [str(mappings[k][-1])]
                if pp_size > 1:
                    fqn.append(f"|pp-{pp_rank:04d}")
                if tp_size > 1:
                    fqn.append(f"|tp-{tp_rank:04d}")
                mappings[k] = (*mappings[k][:-1], "".join(fqn))
    return unflatten_state_dict(new_state_dict, mappings)


@run_with_ranks(4)
def test_zero1_saved_through_dcp_as_nxd_does_converts_and_loads(tmp_path):
    """DP=4: each rank's ZeRO-1 state saved with NxD's use_zero1_dcp code path (its ShardedTensors, stock DCP),
    converted by ``reshard --dp`` with the parameter order, then loaded by load_checkpoint at DP=4: every rank gets
    its state back bit for bit. (NxD's placements name DP ranks 0..DP-1, which stock torch reads as global ranks,
    so on stock torch its code runs only where the DP group is ranks 0..DP-1: TP = PP = 1.)"""
    import torch.distributed.checkpoint as dcp

    from harness.zero1_adamw import Zero1AdamW
    from nxd_ckpt.testing.fakes import assert_state_equal
    from nxd_ckpt.tools.reshard import reshard
    from nxd_ckpt.tools.zero1_dcp import param_order_of

    rank = dist.get_rank()
    model = StageModel(1, 0, None, {n: t.float() for n, t in reference().items()})
    opt = Zero1AdamW(model.parameters(), lr=0.1, save_master_weights=False)
    (sum((p * p).sum() for p in model.parameters()) * (rank + 1)).backward()
    opt.step()
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(ckpt, "nxd_dcp", model=model)  # the model files as NxD writes them
    state = opt.state_dict()
    pid_to_param = {pid: p for g in opt.param_groups for pid, p in enumerate(g["params"])}
    names = {p: n for n, p in model.named_parameters()}
    wrapped = _nxd_wrap_optim_state_dict(
        state, {k: names[v] for k, v in pid_to_param.items()}, pid_to_param, 0, 1, 0, 1, (rank, 4, dist.group.WORLD)
    )
    dcp.save(wrapped, checkpoint_id=os.path.join(ckpt, "nxd_dcp", "optim"))  # NxD: FileSystemWriter + default planner
    dist.barrier()
    if rank == 0:
        from nxd_ckpt.tools.zero1_dcp import NxdZero1Dcp

        saved = NxdZero1Dcp(os.path.join(ckpt, "nxd_dcp"))
        assert (saved.tp, saved.pp) == (1, 1) and set(saved.names(0, 0)) == set(names.values())
        err = None
        try:
            reshard(nxd.open_checkpoint(ckpt, "nxd_dcp"), tmp_path / "out", dp=4)
        except CheckpointError as e:
            err = str(e)
        assert err is not None and "--param-order" in err and not (tmp_path / "out" / "nxd_dcp").exists()
        reshard(
            nxd.open_checkpoint(ckpt, "nxd_dcp"), tmp_path / "out", dp=4, param_order={0: param_order_of(model, opt)}
        )
    dist.barrier()
    model2 = StageModel(1, 0, None, {n: torch.zeros_like(t).float() for n, t in reference().items()})
    opt2 = Zero1AdamW(model2.parameters(), lr=0.1, save_master_weights=False)
    nxd.load_checkpoint(str(tmp_path / "out"), "nxd_dcp", model=model2, optimizer=opt2)
    assert_state_equal(opt2.state_dict()["base_state"], state["base_state"])
    from nxd_ckpt.tree import nxd_containers  # NxD's files hold lists where the optimizer had tuples (betas)

    assert opt2.state_dict()["param_groups"] == nxd_containers(state["param_groups"])
    assert_state_equal(dict(model2.state_dict()), dict(model.state_dict()))
    dist.barrier()


def test_zero1_dcp_keys_of_tp_and_pp_ranks(tmp_path):
    """NxD's key suffixes (``|pp-PPPP|tp-TTTT``) place each slot on its coordinate; converted to DP=2 files."""
    import torch.distributed.checkpoint as dcp

    from nxd_ckpt.storage import LocalStorage
    from nxd_ckpt.tools.zero1_dcp import NxdZero1Dcp, convert

    g = torch.Generator().manual_seed(3)
    state = {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    full = {}
    for pp in range(2):
        for tp in range(2):
            for name in (f"s{pp}.a", f"s{pp}.b"):
                for slot in ("exp_avg", "exp_avg_sq"):
                    full[(pp, tp, name, slot)] = torch.randn(5, 3, generator=g)
                    state[f"base_state.{name}.{slot}|pp-{pp:04d}|tp-{tp:04d}"] = full[(pp, tp, name, slot)]
                state[f"base_state.{name}.step"] = torch.tensor(4.0)
    optim = tmp_path / "t" / "optim"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(optim), no_dist=True)
    src = NxdZero1Dcp(str(tmp_path / "t"))
    assert (src.tp, src.pp) == (2, 2) and src.names(1, 1) == ["s1.a", "s1.b"]
    storage = LocalStorage(str(tmp_path / "out"))
    convert(src, storage, "t", 2, {0: ["s0.b", "s0.a"], 1: ["s1.a", "s1.b"]})
    from nxd_ckpt import statefile

    for pp in range(2):
        for tp in range(2):
            order = ["s0.b", "s0.a"] if pp == 0 else ["s1.a", "s1.b"]
            for d in range(2):
                got = statefile.read_state_file(
                    storage, f"t/optim/dp_rank_{d:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
                )
                assert got["shape_info"] == {0: [5, 3], 1: [5, 3]}
                for pid, name in enumerate(order):
                    want = full[(pp, tp, name, "exp_avg")]
                    rows = want[3 * d : 3 * d + 3]
                    assert torch.equal(got["base_state"][pid]["exp_avg"][: len(rows)], rows)
                    assert torch.equal(got["base_state"][pid]["step"], torch.tensor(4.0))
    with pytest.raises(CheckpointError, match="does not name"):
        convert(src, LocalStorage(str(tmp_path / "out2")), "t", 2, {0: ["s0.a"], 1: ["s1.a", "s1.b"]})
