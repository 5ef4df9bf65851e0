"""The offline ZeRO-1 converter on synthetic NxD-layout checkpoints (TP=2, plain and xser) and on real
torch_xla ZeroRedundancyOptimizer state (XLA lane); values checked against an independent merge written here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import nxd_ckpt as nxd
from nxd_ckpt import statefile
from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal
from nxd_ckpt.tools.convert_zero1 import convert_zero1
from nxd_ckpt.tools.zero1_cli import main

pytestmark = pytest.mark.usefixtures("xser_file_per_tensor")  # these tests look at individual tensor files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "step_9"
SHAPES = {0: (10, 3), 1: (7,), 2: (1, 4), 3: (13, 2)}


# --------------------------------------------------------------------------------------------- independent model


def xla_shard(full: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """torch_xla's sharding: pad dim 0 to a multiple of dp, chunk, take chunk ``rank``."""
    if full.size(0) % dp:
        full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, dp - full.size(0) % dp])
    return full.chunk(dp)[rank].clone()


def shard_of(full: dict, dp: int, rank: int) -> dict:
    out = dict(full)
    out["base_state"] = {
        i: {k: (v.clone() if k == "step" else xla_shard(v, dp, rank)) for k, v in per.items()}
        for i, per in full["base_state"].items()
    }
    out["sharded_master_weights"] = {i: xla_shard(v, dp, rank) for i, v in full["sharded_master_weights"].items()}
    return out


def merged_from_files(shard_states: list[dict]) -> dict:
    """Independent merge: concatenate the DP chunks in order, cut to shape_info rows."""
    first = shard_states[0]
    out = dict(first)
    out["base_state"] = {
        i: {
            k: (
                v
                if k == "step"
                else torch.cat([s["base_state"][i][k] for s in shard_states])[: first["shape_info"][i][0]]
            )
            for k, v in per.items()
        }
        for i, per in first["base_state"].items()
    }
    out["sharded_master_weights"] = {
        i: torch.cat([s["sharded_master_weights"][i] for s in shard_states])[: first["shape_info"][i][0]]
        for i in first["sharded_master_weights"]
    }
    return out


def full_state(seed: int, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": {},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "weight_decay": 0.0, "params": list(SHAPES)}],
        "base_state": {
            i: {
                "step": torch.tensor(9.0),
                "exp_avg": torch.randn(s, generator=g).to(dtype),
                "exp_avg_sq": torch.rand(s, generator=g).to(dtype),
            }
            for i, s in SHAPES.items()
        },
        "shape_info": {i: torch.Size(s) for i, s in SHAPES.items()},
        "sharded_master_weights": {i: torch.randn(s, generator=g) for i, s in SHAPES.items()},
    }


def write_checkpoint(root: str, dp: int, tp: int, use_xser: bool, metadata: bool = True, pp: int = 1) -> dict:
    """An NxD-layout tag ``root/TAG`` with ZeRO-1 shards for ``dp``; returns the full state of each TP rank
    (PP=1) or of each (TP, PP) coordinate."""
    storage = LocalStorage(root)
    fulls = {
        (t, p): full_state(seed=10 * p + t, dtype=torch.bfloat16 if t == 1 else torch.float32)
        for t in range(tp)
        for p in range(pp)
    }
    if pp == 2:  # the second stage holds other parameters
        for t in range(tp):
            for key in ("base_state", "shape_info", "sharded_master_weights"):
                del fulls[(t, 1)][key][0]
    storage.write_bytes(layout.tag_path(TAG, layout.CHECKPOINT_MARKER), b"1")
    for t, p in fulls:
        model = {"w": torch.randn(4, 4), "b": torch.arange(4.0) + t}
        statefile.write_state_file(storage, layout.model_file(TAG, t, p), model, xser_encoding=use_xser)
        for d in range(dp):
            path = layout.optim_file(TAG, d, t, p)
            statefile.write_state_file(storage, path, shard_of(fulls[(t, p)], dp, d), xser_encoding=use_xser)
    with storage.open_write(layout.tag_path(TAG, layout.SCHEDULER_FILE)) as f:
        torch.save({"last_epoch": 9}, f)
    with storage.open_write(layout.tag_path(TAG, layout.USER_CONTENT_FILE)) as f:
        torch.save({"step": 9}, f)
    if metadata:
        meta = {
            "format": "nxd_ckpt",
            "format_version": 1,
            "tag": TAG,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "world_size": tp * pp * dp},
            "zero1": True,
            "zero1_dp_size": dp,
            "xser": use_xser,
        }
        storage.write_bytes(layout.tag_path(TAG, layout.METADATA_FILE), json.dumps(meta).encode())
    storage.write_bytes(layout.tag_path(TAG, layout.DONE_MARKER), b"1")
    return fulls if pp > 1 else {t: fulls[(t, 0)] for t in range(tp)}


def read_optim(root: str, name: str) -> dict:
    return statefile.read_state_file(LocalStorage(root), f"{TAG}/optim/{name}")


def tree_files(tag_dir: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(tag_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), tag_dir)
            with open(os.path.join(dirpath, name), "rb") as f:
                out[rel] = f.read()
    return out


# --------------------------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@pytest.mark.parametrize(("src_dp", "dst_dp"), [(4, 2), (2, 4), (4, 3)])
def test_sharded_to_sharded_tp2(tmp_path, use_xser, src_dp, dst_dp):
    src, dst = str(tmp_path / "in"), str(tmp_path / "out")
    fulls = write_checkpoint(src, src_dp, tp=2, use_xser=use_xser)
    report = convert_zero1(f"{src}/{TAG}", f"{dst}/{TAG}", dp_size=dst_dp, num_workers=2, progress=False)
    assert (report.src_dp, report.dst_dp, report.tp, report.pp, report.xser) == (src_dp, dst_dp, 2, 1, use_xser)

    names = sorted(n for n in os.listdir(f"{dst}/{TAG}/optim") if n.endswith(".pt") and not n.endswith(".info.pt"))
    assert names == sorted(layout.state_file_name(d, t, 0) for d in range(dst_dp) for t in range(2))
    for t in range(2):
        inputs = [read_optim(src, layout.state_file_name(d, t, 0)) for d in range(src_dp)]
        merged = merged_from_files(inputs)
        assert_state_equal(merged, fulls[t])  # the independent merge of the input is the original state
        for d in range(dst_dp):
            got = read_optim(dst, layout.state_file_name(d, t, 0))
            assert_state_equal(got, shard_of(merged, dst_dp, d))
        assert statefile.is_xser_file(LocalStorage(dst), f"{TAG}/optim/{layout.state_file_name(0, t, 0)}") is use_xser

    # Everything else is carried over byte for byte; the metadata records the new DP size; done exists.
    before, after = tree_files(f"{src}/{TAG}"), tree_files(f"{dst}/{TAG}")
    carried = {k for k in before if not k.startswith("optim/") and k != "nxd_ckpt.json"}
    assert carried <= set(after) and all(before[k] == after[k] for k in carried)
    assert any(k.startswith("model/") and ".tensors/" in k for k in carried) is use_xser
    meta = json.loads(after["nxd_ckpt.json"])
    assert (meta["zero1_dp_size"], meta["zero1_full"], meta["converted_from"]["zero1_dp_size"]) == (
        dst_dp,
        False,
        src_dp,
    )
    assert nxd.list_checkpoint_tags(dst) == [TAG]


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_sharded_to_full_to_sharded(tmp_path, use_xser):
    """TP=2, PP=2 (the stages hold different parameters): DP=4 -> full -> DP=3."""
    src, full_dir, back = str(tmp_path / "in"), str(tmp_path / "full"), str(tmp_path / "back")
    fulls = write_checkpoint(src, 4, tp=2, use_xser=use_xser, pp=2)
    report = convert_zero1(f"{src}/{TAG}", f"{full_dir}/{TAG}", convert_to_full=True, num_workers=3, progress=False)
    assert (report.tp, report.pp, report.dst_dp) == (2, 2, None)
    assert not any(n.startswith("dp_rank") for n in os.listdir(f"{full_dir}/{TAG}/optim"))
    for t, p in fulls:
        got = read_optim(full_dir, f"full_tp_rank_{t:02d}_pp_rank_{p:02d}.pt")
        inputs = [read_optim(src, layout.state_file_name(d, t, p)) for d in range(4)]
        assert_state_equal(got, merged_from_files(inputs))
        assert_state_equal(got, fulls[(t, p)])
    with open(f"{full_dir}/{TAG}/nxd_ckpt.json") as f:
        meta = json.load(f)
    assert (meta["zero1_dp_size"], meta["zero1_full"]) == (None, True)

    convert_zero1(f"{full_dir}/{TAG}", f"{back}/{TAG}", dp_size=3, convert_to_sharded=True, progress=False)
    for t, p in fulls:
        for d in range(3):
            assert_state_equal(read_optim(back, layout.state_file_name(d, t, p)), shard_of(fulls[(t, p)], 3, d))
    with pytest.raises(FormatError, match="already holds full"):
        convert_zero1(f"{full_dir}/{TAG}", f"{tmp_path}/again/{TAG}", convert_to_full=True)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_markerless_optim_folder_as_nxd_converter_writes_it(tmp_path, use_xser, capsys):
    """NxD's converter writes only ``<output_dir>/optim/...`` (no markers, no model): given with NxD's flags,
    that folder is the tag folder to convert, as NxD's converter accepts it (issue 25's regression; the real
    converter's output is checked in tests/thirdparty)."""
    src = str(tmp_path / "in")
    fulls = write_checkpoint(src, 2, tp=2, use_xser=use_xser)
    convert_zero1(f"{src}/{TAG}", f"{tmp_path}/full/{TAG}", convert_to_full=True, progress=False)
    bare = tmp_path / "bare" / TAG
    shutil.copytree(tmp_path / "full" / TAG / layout.OPTIM_DIR, bare / layout.OPTIM_DIR)
    out = f"{tmp_path}/sh/{TAG}"
    args = ["--input_dir", str(bare), "--output_dir", out, "--convert_to_sharded", "--dp_size", "3", "--quiet"]
    assert main(args) == 0, capsys.readouterr().err
    for t in range(2):
        for d in range(3):
            assert_state_equal(read_optim(f"{tmp_path}/sh", layout.state_file_name(d, t, 0)), shard_of(fulls[t], 3, d))
    assert nxd.verify(f"{tmp_path}/sh", TAG).ok


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_load_checkpoint_reshards_and_reads_converted(tmp_path, use_xser):
    """One process (DP=1, TP=1): load_checkpoint re-shards a DP=4 checkpoint on the fly, and reads the offline
    conversions (DP=1 shards, full files) directly; all give the DP=1 shard, i.e. the whole state."""
    src = str(tmp_path / "in")
    fulls = write_checkpoint(src, 4, tp=1, use_xser=use_xser, metadata=False)  # names alone say DP=4
    expected = shard_of(fulls[0], 1, 0)
    online: dict = {}
    nxd.load_checkpoint(src, TAG, optimizer=online)
    assert_state_equal(online, expected)
    for kwargs in ({"dp_size": 1}, {"convert_to_full": True}):
        out = str(tmp_path / f"out_{len(kwargs)}_{next(iter(kwargs))}")
        convert_zero1(f"{src}/{TAG}", f"{out}/{TAG}", progress=False, **kwargs)
        loaded: dict = {}
        assert nxd.load_checkpoint(out, optimizer=loaded) == {"step": 9}
        assert_state_equal(loaded, expected)


# --------------------------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_and_nothing_looks_complete(tmp_path):
    src = str(tmp_path / "in")
    write_checkpoint(src, 4, tp=2, use_xser=False)
    out = f"{tmp_path}/out/{TAG}"

    with pytest.raises(ValueError, match="dp_size"):
        convert_zero1(f"{src}/{TAG}", out)
    with pytest.raises(ValueError, match="dp_size"):
        convert_zero1(f"{src}/{TAG}", out, dp_size=0)
    with pytest.raises(ValueError, match="differ"):
        convert_zero1(f"{src}/{TAG}", f"{src}/{TAG}", dp_size=2)

    # A shard whose shapes disagree with shape_info: refused, and the output never gets 'done'.
    bad = read_optim(src, layout.state_file_name(1, 1, 0))
    bad["base_state"][3]["exp_avg"] = torch.zeros(3, 2)  # DP=4 shards of 13 rows have 4
    torch.save(bad, f"{src}/{TAG}/optim/{layout.state_file_name(1, 1, 0)}")
    with pytest.raises(FormatError, match=r"dp_rank_01_tp_rank_01.*\[3\]\['exp_avg'\].*\(3, 2\).*shape_info"):
        convert_zero1(f"{src}/{TAG}", out, dp_size=2, progress=False)
    assert not os.path.exists(f"{out}/done")

    # Missing shard files are named.
    os.unlink(f"{src}/{TAG}/optim/{layout.state_file_name(2, 0, 0)}")
    os.unlink(f"{src}/{TAG}/optim/{layout.state_file_name(3, 1, 0)}")
    with pytest.raises(FormatError, match=r"missing: .*dp_rank_02_tp_rank_00_pp_rank_00\.pt, .*dp_rank_03_tp_rank_01"):
        convert_zero1(f"{src}/{TAG}", f"{tmp_path}/out2/{TAG}", dp_size=2)
    assert not os.path.exists(f"{tmp_path}/out2")


def test_not_zero1_and_existing_output(tmp_path):
    plain_dir = tmp_path / "replicated" / TAG
    (plain_dir / "optim").mkdir(parents=True)
    torch.save(
        {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []},
        plain_dir / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt",
    )
    with pytest.raises(FormatError, match="not a ZeRO-1 optimizer state"):
        convert_zero1(str(plain_dir), f"{tmp_path}/o/{TAG}", dp_size=2)
    (tmp_path / "empty" / TAG).mkdir(parents=True)
    with pytest.raises(FormatError, match="not a ZeRO-1 checkpoint"):
        convert_zero1(f"{tmp_path}/empty/{TAG}", f"{tmp_path}/o/{TAG}", dp_size=2)

    src = str(tmp_path / "in")
    fulls = write_checkpoint(src, 2, tp=1, use_xser=False)
    out = f"{tmp_path}/out/{TAG}"
    convert_zero1(f"{src}/{TAG}", out, dp_size=3, progress=False)
    with pytest.raises(CheckpointError, match="already holds a checkpoint.*--overwrite"):
        convert_zero1(f"{src}/{TAG}", out, dp_size=4)
    assert len(os.listdir(f"{out}/optim")) == 3  # untouched
    convert_zero1(f"{src}/{TAG}", out, dp_size=4, overwrite=True, progress=False)
    assert sorted(os.listdir(f"{out}/optim")) == [layout.state_file_name(d, 0, 0) for d in range(4)]
    assert_state_equal(read_optim(f"{tmp_path}/out", layout.state_file_name(3, 0, 0)), shard_of(fulls[0], 4, 3))


def test_command_line(tmp_path, capsys):
    src = str(tmp_path / "in")
    write_checkpoint(src, 4, tp=1, use_xser=False)
    args = ["--input_dir", f"{src}/{TAG}", "--output_dir", f"{tmp_path}/o/{TAG}", "--quiet"]
    assert main([*args, "--convert_to_sharded"]) == 2
    assert "--dp-size (dp_size) must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one of the two directions is required
        main(args)
    assert main([*args, "--convert_to_sharded", "--dp_size", "2", "--num_workers", "2"]) == 0
    assert "DP=4 -> DP=2" in capsys.readouterr().out
    assert main([*args, "--convert_to_sharded", "--dp_size", "3"]) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err

    # The script with NxD's flags runs the same tool.
    script = os.path.join(REPO, "scripts", "convert_zero1_checkpoint.py")
    res = subprocess.run(
        [
            sys.executable,
            script,
            "--input_dir",
            f"{src}/{TAG}",
            "--output_dir",
            f"{tmp_path}/f/{TAG}",
            "--convert_to_full",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert os.path.exists(f"{tmp_path}/f/{TAG}/optim/full_tp_rank_00_pp_rank_00.pt")
    assert os.path.exists(f"{tmp_path}/f/{TAG}/done")


# --------------------------------------------------------------------------------------------- real torch_xla


@pytest.mark.xla
@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_real_zero_redundancy_optimizer_state(tmp_path, use_xser):
    """torch_xla's ZeroRedundancyOptimizer (a world of 1 on CPU, so DP=1): its saved state is re-sharded to
    DP=3 and merged back; the round trip loads into a fresh optimizer and training continues bit-identically."""
    torch_xla = pytest.importorskip("torch_xla")
    zero_module = pytest.importorskip("torch_xla.distributed.zero_redundancy_optimizer")
    from nxd_ckpt.testing.fakes import TinyMLP

    def make(seed: int):
        torch.manual_seed(seed)
        model = TinyMLP(d_hidden=10).to(torch_xla.device())
        opt = zero_module.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True
        )
        return model, opt

    def steps(model, opt, n: int, seed: int) -> list[float]:
        losses = []
        for i in range(n):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            loss = F.mse_loss(model(x.to(torch_xla.device())), y.to(torch_xla.device()))
            loss.backward()
            opt.step()
            torch_xla.sync()
            losses.append(float(loss.detach().cpu()))
        return losses

    model, opt = make(0)
    steps(model, opt, 3, seed=1)
    root = str(tmp_path / "ckpt")
    nxd.save_checkpoint(root, TAG, model=model, optimizer=opt, use_xser=use_xser)
    reference = steps(model, opt, 3, seed=2)

    saved = read_optim(root, layout.state_file_name(0, 0, 0))
    convert_zero1(f"{root}/{TAG}", f"{tmp_path}/dp3/{TAG}", dp_size=3, progress=False)
    shards = [read_optim(f"{tmp_path}/dp3", layout.state_file_name(d, 0, 0)) for d in range(3)]
    for d, shard in enumerate(shards):
        assert shard["base_state"][0]["exp_avg"].shape == (4, 8)  # 10 rows padded to 12
        assert_state_equal(shard, shard_of(saved, 3, d))
    assert_state_equal(merged_from_files(shards), saved)

    convert_zero1(f"{tmp_path}/dp3/{TAG}", f"{tmp_path}/dp1/{TAG}", dp_size=1, progress=False)
    model2, opt2 = make(5)
    nxd.load_checkpoint(f"{tmp_path}/dp1", TAG, model=model2, optimizer=opt2)
    assert steps(model2, opt2, 3, seed=2) == reference


@pytest.mark.parametrize("metadata", [True, False], ids=["nxd_ckpt", "nxd-written"])
def test_converted_tags_carry_manifests_and_load_verified(tmp_path, metadata):
    """Every file of the output is checksummed: verify() passes, and a flipped byte in a converted optimizer
    file is caught and named by the (default, verified) load."""
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    fulls = write_checkpoint(src, 4, tp=1, use_xser=False, metadata=metadata)
    convert_zero1(f"{src}/{TAG}", f"{out}/{TAG}", dp_size=2, convert_to_sharded=True, progress=False)
    manifests = os.listdir(f"{out}/{TAG}/{layout.EXTRAS_DIR}")
    assert manifests and all(n.startswith("manifest_") for n in manifests)
    assert manifests == ["manifest_rank_00000.json"]  # one writer: no empty manifests for other ranks
    loaded: dict = {}
    nxd.load_checkpoint(out, TAG, optimizer=loaded)  # verified, and re-sharded DP=2 -> 1 on the fly
    assert_state_equal(loaded, shard_of(fulls[0], 1, 0))
    report = nxd.verify(out, TAG)
    assert report.ok and report.manifests == len(manifests), report.summary()

    victim = f"{out}/{TAG}/optim/{layout.state_file_name(1, 0, 0)}"
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = nxd.verify(out, TAG)
    assert not damaged.ok and any(layout.state_file_name(1, 0, 0) in p for p in damaged.problems), damaged.summary()
    with pytest.raises(CheckpointError, match=layout.state_file_name(1, 0, 0)):
        nxd.load_checkpoint(out, TAG, optimizer={})


# --------------------------------------------------------------------------------------------- one view of a tag


def _views(root: str) -> dict:
    """What list, inspect, verify (Python and CLI) and the loader say about ``root``'s tag."""
    import contextlib
    import io

    from nxd_ckpt import cli
    from nxd_ckpt.format.describe import describe
    from nxd_ckpt.load import zero1_io
    from nxd_ckpt.ranks.topology import Topology

    def run_cli(*args: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            status = cli.main(list(args))
        return status, out.getvalue()

    _, listed = run_cli("list", root, "--json")
    _, inspected = run_cli("inspect", root, "--json")
    verify_status, _ = run_cli("verify", root)
    listed_layout = json.loads(listed)["tags"][0]["layout"]
    inspected_layout = json.loads(inspected)["layout"]
    desc = describe(LocalStorage(root), TAG)
    loader = zero1_io.reshard_source(desc, Topology())
    return {
        "list": (listed_layout["dp"], listed_layout["zero1"], listed_layout["zero1_full"]),
        "inspect": (inspected_layout["dp"], inspected_layout["zero1"], inspected_layout["zero1_full"]),
        "api": (nxd.open_checkpoint(root).layout().dp, desc.zero1, desc.zero1_full),
        "loader": (loader[1], desc.zero1, desc.zero1_full),
        "verify": (nxd.verify(root).ok, verify_status == 0),
    }


@pytest.mark.parametrize("metadata", [True, False], ids=["nxd_ckpt", "nxd-written"])
def test_every_conversion_is_seen_alike_and_verifies(tmp_path, metadata):
    """After DP 4 -> 2, to full and full -> 3 shards: list, inspect, the Python API and the loader agree on the DP
    size and the kind of ZeRO-1 state; verify passes in Python and on the command line; one manifest each."""
    src = str(tmp_path / "in")
    fulls = write_checkpoint(src, 4, tp=1, use_xser=False, metadata=metadata)
    steps = [
        (src, "dp2", {"dp_size": 2}, (2, True, False)),
        (src, "full", {"convert_to_full": True}, (None, True, True)),
        (str(tmp_path / "full"), "dp3", {"dp_size": 3}, (3, True, False)),
    ]
    for source, name, kwargs, expected in steps:
        out = str(tmp_path / name)
        convert_zero1(f"{source}/{TAG}", f"{out}/{TAG}", progress=False, **kwargs)
        views = _views(out)
        assert views.pop("verify") == (True, True), name
        assert set(views.values()) == {expected}, (name, views)
        assert os.listdir(f"{out}/{TAG}/{layout.EXTRAS_DIR}") == ["manifest_rank_00000.json"]
        loaded: dict = {}
        nxd.load_checkpoint(out, TAG, optimizer=loaded)  # verified; re-sharded to this process's DP=1
        assert_state_equal(loaded, shard_of(fulls[0], 1, 0))
