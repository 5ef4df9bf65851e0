"""``nxd-ckpt`` run as a subprocess on real checkpoints: exit codes, key output lines, ``--json`` parsed."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import zipfile
from pathlib import Path

import pytest
import torch

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt.cli import main
from nxd_ckpt.testing.fakes import TinyMLP, make_training, train_steps

pytestmark = pytest.mark.device_independent  # the command reads and writes host files: runs once, in the CPU lane

MODEL = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def run(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """``nxd-ckpt ARGS`` in a fresh interpreter; asserts the exit status unless ``check`` is None."""
    proc = subprocess.run(
        [sys.executable, "-m", "nxd_ckpt.cli", *args], capture_output=True, text=True, timeout=280, check=False
    )
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture
def cli(capsys):
    """``nxd-ckpt ARGS`` in this process through ``main(argv)`` (cheap); returns (stdout, stderr)."""

    def call(*args: str, check: int = 0) -> tuple[str, str]:
        status = main(list(args))
        out, err = capsys.readouterr()
        assert status == check, f"exit {status}\nstdout:\n{out}\nstderr:\n{err}"
        return out, err

    return call


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    """step_1 plain, step_2 xser, step_3 interrupted (no ``done``), all of TinyMLP + AdamW + StepLR."""
    d = tmp_path_factory.mktemp("ckpts")
    model, opt, sched = make_training(seed=1, device="cpu")
    train_steps(model, opt, sched, 2, seed=1)
    nxd.save_checkpoint(d, "step_1", model=model, optimizer=opt, scheduler=sched, user_content={"step": 1})
    train_steps(model, opt, sched, 1, seed=2)
    # One file per tensor even for TinyMLP's small tensors (the writer may keep small ones in the reference file).
    saved_env = os.environ.get("NXD_CKPT_XSER_INLINE_BYTES")
    os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = "0"
    try:
        nxd.save_checkpoint(
            d, "step_2", model=model, optimizer=opt, scheduler=sched, user_content={"step": 2}, use_xser=True
        )
    finally:
        if saved_env is None:
            del os.environ["NXD_CKPT_XSER_INLINE_BYTES"]
        else:
            os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = saved_env
    nxd.save_checkpoint(d, "step_3", model=model)
    os.remove(d / "step_3" / "done")
    torch.save(model.state_dict(), d / "expected_model.pt")
    nxd.reset_manager()
    return d


def _save_parallel(out: str) -> None:
    """On 2 ranks: a TP=2 checkpoint, a PP=2 one, then a DP=2 ZeRO-1 one."""
    import torch.distributed as dist

    from harness.zero1_adamw import Zero1AdamW

    nxd.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(dist.get_rank())
    nxd.save_checkpoint(os.path.join(out, "tp2"), "step_1", model=TinyMLP())
    nxd.destroy_model_parallel()
    nxd.initialize_model_parallel(pipeline_model_parallel_size=2)  # each stage holds its own layers
    stage = {f"layers.{dist.get_rank()}.weight": torch.full((2, 3), float(dist.get_rank()))}
    nxd.save_checkpoint(os.path.join(out, "pp2"), "step_1", model=stage)
    nxd.destroy_model_parallel()
    torch.manual_seed(0)
    model = TinyMLP()
    opt = Zero1AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    nxd.save_checkpoint(os.path.join(out, "zero1"), "step_1", model=model, optimizer=opt, zero1_optimizer=True)


@pytest.fixture(scope="module")
def parallel_dirs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("parallel")
    run_on_ranks(_save_parallel, 2, {"out": str(d)})
    return d


def test_help_version_and_usage_errors(cli):
    proc = run("--help")
    assert "inspect" in proc.stdout and "Exit status" in proc.stdout
    proc = run("bogus", check=2)
    assert "invalid choice" in proc.stderr and proc.stdout == ""
    assert cli("--version")[0].startswith("nxd-ckpt ")
    assert "--keep" in cli("prune", "/nonexistent", check=2)[1]  # required option missing
    assert "must be at least 1" in cli("prune", "/nonexistent", "--keep", "0", check=2)[1]
    assert "no such directory" in cli("list", "/nonexistent/dir", check=1)[1]
    assert "no such directory" in cli("list", "/nonexistent/dir", "--no-progress", check=1)[1]  # global option after


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("nxd-ckpt")
    if not script.exists():
        pytest.skip("the package was installed without its console scripts")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=280, check=True)
    assert proc.stdout.startswith("nxd-ckpt ")


def test_list(ckpt_dir, parallel_dirs, cli):
    lines = run("list", str(ckpt_dir)).stdout.splitlines()
    assert lines[0].split()[:3] == ["TAG", "STATUS", "SIZE"]
    assert [line.split()[0] for line in lines[1:]] == ["step_1", "step_2", "step_3"]
    assert "complete" in lines[1] and "latest" not in lines[1]
    assert "complete, latest" in lines[2] and "xser" in lines[2]
    assert "incomplete" in lines[3]
    listing = json.loads(cli("list", str(ckpt_dir), "--json")[0])
    assert listing["latest"] == "step_2"
    assert [(t["tag"], t["complete"], t["latest"]) for t in listing["tags"]] == [
        ("step_1", True, False),
        ("step_2", True, True),
        ("step_3", False, False),
    ]
    assert listing["tags"][1]["layout"]["xser"] and listing["tags"][0]["size"] > 0
    zero1 = json.loads(cli("list", str(parallel_dirs / "zero1"), "--json")[0])["tags"][0]["layout"]
    assert (zero1["dp"], zero1["tp"], zero1["pp"], zero1["zero1"]) == (2, 1, 1, True)
    assert "DP=2 TP=1 PP=1, ZeRO-1" in cli("list", str(parallel_dirs / "zero1"))[0]
    assert "TP=2" in cli("list", str(parallel_dirs / "tp2"))[0]
    assert "no checkpoints" in cli("list", str(parallel_dirs))[1]
    # A tag folder: `list` suggests the directory holding it (list has no --tag), inspect suggests --tag.
    hint = cli("list", str(ckpt_dir / "step_1"), check=1)[1]
    assert f"nxd-ckpt list {ckpt_dir}\n" in hint and "--tag" not in hint
    assert f"nxd-ckpt inspect {ckpt_dir} --tag step_1" in cli("inspect", str(ckpt_dir / "step_1"), check=1)[1]


def test_inspect(ckpt_dir, cli):
    expected = torch.load(ckpt_dir / "expected_model.pt")
    report = json.loads(run("inspect", str(ckpt_dir), "--tag", "step_1", "--json").stdout)
    assert report["tag"] == "step_1" and report["complete"] and not report["layout"]["xser"]
    model = next(s for s in report["state_files"] if s["prefix"] == "model/tp00_pp00")
    assert model["encoding"] == "plain"
    shapes = {o["path"]: o["shape"] for o in model["objects"]}
    assert shapes == {f"model/tp00_pp00/{k}": list(v.shape) for k, v in expected.items()}
    assert model["tensor_bytes"] == sum(v.nbytes for v in expected.values())
    assert report["totals"]["tensors"] == 17 and report["totals"]["files"] == len(report["files"])

    text = cli("inspect", str(ckpt_dir))[0]
    assert text.startswith(f"checkpoint {ckpt_dir}/step_2 (complete)")
    assert "layout: DP=1 TP=1 PP=1, xser" in text
    assert f"  {MODEL}.tensors/ (5 files)" in text and "  nxd_ckpt.json" in text
    assert any(line.split()[:3] == ["fc1.weight", "float32", "[16,"] for line in text.splitlines())
    assert "total: 4 state files, 17 tensors" in text
    one = json.loads(cli("inspect", str(ckpt_dir), "--object", "model/tp00_pp00/fc2.bias", "--json")[0])
    assert one["object"]["values"] == expected["fc2.bias"].tolist()
    assert cli("inspect", str(ckpt_dir), "--object", "user_content/step")[0].splitlines()[-1] == "2"
    assert "no key 'nope'" in cli("inspect", str(ckpt_dir), "--object", "model/tp00_pp00/nope", check=1)[1]
    assert "INCOMPLETE" in cli("inspect", str(ckpt_dir), "--tag", "step_3")[0]
    assert "does not exist" in cli("inspect", str(ckpt_dir), "--tag", "step_9", check=1)[1]


class Opaque:
    """A user class in user content: inspecting needs --allow-pickle for that file only."""

    def __init__(self) -> None:
        self.n = 3


def test_inspect_unpickling_needs_opt_in_and_shows_the_rest(tmp_path, cli):
    nxd.save_checkpoint(tmp_path, "t", model={"w": torch.ones(2)}, user_content={"obj": Opaque()})
    out, err = cli("inspect", str(tmp_path))
    assert "user_content.pt  [user_content]" in out and "(not readable" in out and "  w  " in out
    assert "--allow-pickle" in err and "Opaque" in err
    out, _ = cli("inspect", str(tmp_path), "--allow-pickle")
    assert "  obj  Opaque" in out
    (tmp_path / "t" / MODEL).write_bytes(b"not a zip")
    assert "model/tp00_pp00" in cli("inspect", str(tmp_path), check=1)[0]


def test_verify_good_and_broken(ckpt_dir, tmp_path, cli):
    proc = run("verify", str(ckpt_dir))
    assert proc.stdout.startswith("step_2: OK") and "%|" not in proc.stderr  # no progress bar off a terminal
    report = json.loads(cli("verify", str(ckpt_dir), "--all", "--json")[0])
    assert report["ok"] and [t["tag"] for t in report["tags"]] == ["step_1", "step_2"]
    assert "done" in cli("verify", str(ckpt_dir), "--tag", "step_3", check=1)[1]

    broken = tmp_path / "broken"
    shutil.copytree(ckpt_dir, broken)
    _flip_tensor_byte(broken / "step_1" / MODEL)
    (broken / "step_2" / (MODEL + ".tensors") / "tensor_2.pt").unlink()
    proc = run("verify", str(broken), "--tag", "step_1", check=1)
    assert f"step_1/{MODEL}" in proc.stderr and "FAILED" in proc.stdout
    assert f"step_2/{MODEL}.tensors/tensor_2.pt" in cli("verify", str(broken), "--tag", "step_2", "--quick", check=1)[1]
    report = json.loads(cli("verify", str(broken), "--all", "--json", check=1)[0])
    assert [t["ok"] for t in report["tags"]] == [False, False]


def _flip_tensor_byte(path: Path) -> None:
    """Flip one byte of tensor data (not of the zip structure) in a torch.save file."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0)
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    data[info.header_offset + 30 + name_len + extra_len + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prune(ckpt_dir, tmp_path, cli):
    d = tmp_path / "prune"
    shutil.copytree(ckpt_dir, d)
    assert cli("prune", str(d), "--keep", "1", "--dry-run")[0].splitlines() == ["would delete step_1"]
    assert (d / "step_1").exists()
    assert run("prune", str(d), "--keep", "1").stdout.splitlines() == ["deleted step_1"]
    assert not (d / "step_1").exists() and (d / "step_2" / "done").exists()
    assert (d / "step_3").exists()  # newer than the kept tag: it may be a save in progress
    assert "nothing to delete" in cli("prune", str(d), "--keep", "1")[0]


def test_export(ckpt_dir, parallel_dirs, tmp_path, cli):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    proc = run("export", str(ckpt_dir), "--tag", "step_1", "--out", str(out))
    assert proc.stdout.startswith(f"wrote {out}: 5 tensors")
    exported = load_file(str(out))
    reference = nxd.open_checkpoint(ckpt_dir, "step_1").read("model/tp00_pp00")
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    assert "already exists" in cli("export", str(ckpt_dir), "--out", str(out), check=1)[1]
    cli("export", str(ckpt_dir), "--out", str(out), "--force")  # step_2, xser
    assert torch.equal(load_file(str(out))["fc1.weight"], torch.load(ckpt_dir / "expected_model.pt")["fc1.weight"])

    # TinyMLP has no tensor-parallel marks (recorded as replicated), yet each TP rank saved its own random one
    err = cli("export", str(parallel_dirs / "tp2"), "--out", str(tmp_path / "tp.safetensors"), check=1)[1]
    assert "described as replicated" in err and "TP rank 1's copy differs" in err
    assert not (tmp_path / "tp.safetensors").exists()
    merged = tmp_path / "pp.safetensors"
    cli("export", str(parallel_dirs / "pp2"), "--out", str(merged))  # PP stages hold disjoint layers: merged
    assert {k: v.tolist() for k, v in load_file(str(merged)).items()} == {
        "layers.0.weight": [[0.0] * 3] * 2,
        "layers.1.weight": [[1.0] * 3] * 2,
    }
    shard = tmp_path / "shard1.safetensors"
    cli("export", str(parallel_dirs / "tp2"), "--shard", "model/tp01_pp00", "--out", str(shard))
    assert load_file(str(shard)).keys() == TinyMLP().state_dict().keys()


def test_convert_zero1(parallel_dirs, tmp_path, cli):
    out = tmp_path / "full"
    src = str(parallel_dirs / "zero1" / "step_1")
    run("convert-zero1", "--input_dir", src, "--output_dir", str(out), "--convert_to_full", "--quiet")
    assert (out / "optim" / "full_tp_rank_00_pp_rank_00.pt").exists()
    prefixes = [
        s["prefix"] for s in json.loads(cli("inspect", str(tmp_path), "--tag", "full", "--json")[0])["state_files"]
    ]
    assert "optim/full_tp00_pp00" in prefixes
    assert cli("convert-zero1", "--input_dir", src, check=2)[1]  # --output_dir missing: usage error


def test_progress_bar_only_on_a_terminal(ckpt_dir):
    """With stderr on a pseudo-terminal, verify draws a tqdm bar there; stdout keeps only the result."""
    main_fd, term_fd = pty.openpty()
    fcntl.ioctl(term_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column pty draws nothing
    proc = subprocess.Popen(
        [sys.executable, "-m", "nxd_ckpt.cli", "verify", str(ckpt_dir)], stdout=subprocess.PIPE, stderr=term_fd
    )
    os.close(term_fd)
    drawn = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main_fd)
    assert proc.wait(timeout=280) == 0
    assert proc.stdout.read().decode().startswith("step_2: OK")
    assert b"verify step_2:" in drawn and b"%|" in drawn


def test_list_inspect_metadata_and_help_do_not_import_torch(ckpt_dir):
    """`--help`, `list` and `inspect --metadata` never touch a tensor, so they must not pay for `import torch`."""
    code = (
        "import sys\n"
        "from nxd_ckpt.cli import main\n"
        "argv = sys.argv[1:]\n"
        "status = main(argv)\n"
        "assert status == 0, status\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    for args in (["--help"], ["list", str(ckpt_dir)], ["list", str(ckpt_dir), "--json"], ["convert-zero1", "--help"]):
        if args[-1] == "--help":  # argparse exits from --help: run the check at exit instead
            probe = "import atexit, sys\natexit.register(lambda: print('TORCH', 'torch' in sys.modules))\n"
            proc = subprocess.run(
                [sys.executable, "-c", probe + "from nxd_ckpt.cli import main\nsys.exit(main(sys.argv[1:]))", *args],
                capture_output=True,
                text=True,
                timeout=280,
            )
            assert proc.returncode == 0, proc.stderr
            assert "TORCH False" in proc.stdout, args
            continue
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip().endswith("TORCH_NOT_IMPORTED"), (args, proc.stdout[-300:])
    proc = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(ckpt_dir), "--tag", "step_2", "--metadata"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layout: DP=1 TP=1 PP=1, xser" in proc.stdout and "  xser: true" in proc.stdout
    assert "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors/" in proc.stdout
    assert proc.stdout.rstrip().endswith("TORCH_NOT_IMPORTED")


def test_convert_zero1_takes_the_checkpoint_directory_and_global_options(parallel_dirs, tmp_path, cli):
    src_dir = str(parallel_dirs / "zero1")
    # Global options before the subcommand, the checkpoint directory + --tag like every other command.
    out, _ = cli("-v", "convert-zero1", src_dir, "--tag", "step_1", "--out", str(tmp_path / "a"), "--to-full")
    assert (tmp_path / "a" / "step_1" / "optim" / "full_tp_rank_00_pp_rank_00.pt").exists()
    assert (tmp_path / "a" / "step_1" / "done").exists()
    assert out.count("converted ZeRO-1 optimizer DP=2 -> full") == 1
    # Without --tag: the latest complete tag; hyphenated flags; a new tag name.
    cli(
        "--no-progress", "convert-zero1", src_dir, "--out", str(tmp_path / "b"), "--out-tag", "dp3",
        "--to-sharded", "--dp-size", "3", "--num-workers", "2",
    )  # fmt: skip
    assert sorted(os.listdir(tmp_path / "b" / "dp3" / "optim"))[-1] == "dp_rank_02_tp_rank_00_pp_rank_00.pt"
    # NxD's spellings stay aliases, and its --input_dir may name the checkpoint directory too (latest tag).
    cli(
        "convert-zero1", "--input_dir", src_dir, "--output_dir", str(tmp_path / "c" / "step_1"),
        "--convert_to_sharded", "--dp_size", "1", "--allow_pickle",
    )  # fmt: skip
    assert (tmp_path / "c" / "step_1" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").exists()
    # Summary once, on stdout; stderr (not a terminal) gets no progress lines; errors name the command.
    proc = run("convert-zero1", f"{src_dir}/step_1", "--out", str(tmp_path / "d"), "--to-full")
    assert proc.stdout.count("converted ZeRO-1") == 1 and proc.stderr == ""
    proc = run("convert-zero1", src_dir, "--out", str(tmp_path / "e"), "--to-sharded", check=2)
    assert proc.stderr.startswith("nxd-ckpt convert-zero1: error: --dp-size") and "convert_zero1" not in proc.stderr
    proc = run("convert-zero1", src_dir, "--tag", "step_9", "--out", str(tmp_path / "e"), "--to-full", check=1)
    assert "nxd-ckpt convert-zero1: error: checkpoint tag 'step_9'" in proc.stderr and "--tag" in proc.stderr
    proc = run("convert-zero1", str(tmp_path), "--to-full", check=2)  # no output named: usage error
    assert "usage: nxd-ckpt convert-zero1" in proc.stderr
    proc = run(
        "convert-zero1", f"{src_dir}/step_1", "--tag", "step_1", "--out", str(tmp_path / "f"), "--to-full", check=2
    )
    assert "is one checkpoint (a tag folder); drop --tag" in proc.stderr
