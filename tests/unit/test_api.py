"""save_checkpoint/load_checkpoint in a world of one process: round trips, dict targets, retention, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal, make_training, train_steps


def _saved(tmp_path, tag="step_1", **kw):
    model, opt, sched = make_training(seed=1)
    train_steps(model, opt, sched, 2, seed=1)
    nxd.save_checkpoint(tmp_path, tag, model=model, optimizer=opt, scheduler=sched, user_content={"step": 2}, **kw)
    return model, opt, sched


def test_round_trip_without_torch_distributed(tmp_path):
    model, opt, sched = _saved(tmp_path)
    m2, o2, s2 = make_training(seed=5)
    assert nxd.load_checkpoint(tmp_path, model=m2, optimizer=o2, scheduler=s2) == {"step": 2}
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert_state_equal(opt.state_dict(), o2.state_dict())
    assert s2.state_dict() == sched.state_dict()
    assert nxd.has_checkpoint(tmp_path) and nxd.latest_checkpoint_tag(tmp_path) == "step_1"


def test_dict_targets_are_filled_in_place(tmp_path):
    model, opt, _ = _saved(tmp_path)
    model_sd, opt_sd = {"stale": 1}, {}
    nxd.load_checkpoint(tmp_path, model=model_sd, optimizer=opt_sd)
    assert "stale" not in model_sd
    assert_state_equal(model.state_dict(), model_sd)
    assert_state_equal(opt.state_dict(), opt_sd)


def test_no_user_content_returns_none(tmp_path):
    model = TinyMLP()
    nxd.save_checkpoint(tmp_path, "t", model=model)
    assert nxd.load_checkpoint(tmp_path, model=TinyMLP()) is None
    assert sorted(os.listdir(tmp_path / "t")) == ["checkpoint", "done", "model", "nxd_ckpt", "nxd_ckpt.json"]


def test_retention_and_order(tmp_path):
    model = TinyMLP()
    for step in range(1, 6):
        nxd.save_checkpoint(tmp_path, f"step_{step}", model=model, num_kept_ckpts=2)
    assert nxd.list_checkpoint_tags(tmp_path) == ["step_4", "step_5"]
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "step_4", "step_5"]  # + the index of `latest`


def test_resaving_a_tag_replaces_it(tmp_path):
    model = TinyMLP()
    nxd.save_checkpoint(tmp_path, "t", model=model, user_content=1)
    nxd.save_checkpoint(tmp_path, "t", model=model, user_content=2)
    assert nxd.load_checkpoint(tmp_path, model=TinyMLP()) == 2


def test_error_no_checkpoint(tmp_path):
    with pytest.raises(nxd.CheckpointNotFoundError, match=f"no complete checkpoint in {tmp_path}"):
        nxd.load_checkpoint(tmp_path, model=TinyMLP())


def test_error_unknown_tag_lists_existing(tmp_path):
    _saved(tmp_path, "step_1")
    with pytest.raises(nxd.CheckpointNotFoundError, match="'step_9' .* complete tags: step_1"):
        nxd.load_checkpoint(tmp_path, tag="step_9", model=TinyMLP())


@pytest.mark.parametrize("bad", ["..", "a/b", ""])
def test_error_bad_tag_on_save_and_load(tmp_path, bad):
    with pytest.raises(nxd.InvalidTagError, match="invalid checkpoint tag"):
        nxd.save_checkpoint(tmp_path, bad, model=TinyMLP())
    with pytest.raises(nxd.InvalidTagError, match="invalid checkpoint tag"):
        nxd.load_checkpoint(tmp_path, tag=bad, model=TinyMLP())
    assert not any(tmp_path.iterdir())


def test_error_missing_and_unexpected_keys(tmp_path):
    _saved(tmp_path)

    class Wider(TinyMLP):
        def __init__(self):
            super().__init__()
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(nxd.StateMismatchError, match=r"missing keys \['extra.weight', 'extra.bias'\]"):
        nxd.load_checkpoint(tmp_path, model=Wider())
    narrow = TinyMLP()
    del narrow.fc2
    with pytest.raises(nxd.StateMismatchError, match=r"unexpected keys \['fc2.weight', 'fc2.bias'\]"):
        nxd.load_checkpoint(tmp_path, model=narrow)
    # strict=False loads what matches.
    nxd.load_checkpoint(tmp_path, model=Wider(), strict=False)


def test_error_shape_mismatch_names_key_and_shapes(tmp_path):
    _saved(tmp_path)
    with pytest.raises(nxd.StateMismatchError, match=r"fc1.weight: saved \(16, 8\), model \(32, 8\)"):
        nxd.load_checkpoint(tmp_path, model=TinyMLP(d_hidden=32))


def test_error_layout_mismatch_names_both_layouts(tmp_path):
    # A checkpoint written with TP=2 (two model files), as NxD would lay it out.
    model = TinyMLP()
    for tp in range(2):
        d = tmp_path / "t" / "model"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), d / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt")
    (tmp_path / "t" / "checkpoint").write_text("1")
    (tmp_path / "t" / "done").write_text("1")
    with pytest.raises(nxd.LayoutMismatchError, match=r"saved with TP=2 PP=1 but this job runs TP=1 PP=1"):
        nxd.load_checkpoint(tmp_path, model=TinyMLP())


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_kept_ckpts"):
        nxd.save_checkpoint(tmp_path, "t", model=TinyMLP(), num_kept_ckpts=0)
    with pytest.raises(ValueError, match="num_workers"):
        nxd.save_checkpoint(tmp_path, "t", model=TinyMLP(), num_workers=0)
    with pytest.raises(TypeError, match="state_dict"):
        nxd.save_checkpoint(tmp_path, "t", model=object())


def test_failed_save_keeps_older_checkpoint_latest(tmp_path):
    _saved(tmp_path, "good")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        nxd.save_checkpoint(tmp_path, "bad", model=TinyMLP(), user_content=Unpicklable())
    assert nxd.latest_checkpoint_tag(tmp_path) == "good"
    assert not (tmp_path / "bad" / "done").exists()
    nxd.load_checkpoint(tmp_path, model=TinyMLP())


def test_reads_a_checkpoint_written_the_nxd_way(tmp_path):
    """Plain torch.save files and markers only, no nxd_ckpt metadata: what NxD writes."""
    model, opt, sched = make_training(seed=3)
    train_steps(model, opt, sched, 2, seed=3)
    tag = tmp_path / "step_2"
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    (tag / "checkpoint").write_text("1")
    torch.save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    torch.save(opt.state_dict(), tag / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    torch.save(sched.state_dict(), tag / "scheduler.pt")
    torch.save({"step": 2}, tag / "user_content.pt")
    (tag / "done").write_text("1")
    m2, o2, s2 = make_training(seed=4)
    assert nxd.load_checkpoint(tmp_path, model=m2, optimizer=o2, scheduler=s2) == {"step": 2}
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert_state_equal(opt.state_dict(), o2.state_dict())


def test_the_first_async_save_of_a_process_imports_no_module_of_nxd_ckpt(tmp_path):
    """A script that imports torch, then nxd_ckpt, has the API and every module a save needs from its imports on:
    its first save_checkpoint call pays for no import (the lazy API import was 0.07 s of a fresh process's first
    save with bytecode caches, 0.3-0.5 s without; python -m benchmarks first_save). Fresh process: this one has
    imported everything long ago."""
    code = """
import sys
import torch
import nxd_ckpt as nxd

model = {f"w{i}": torch.randn(1 << 19) for i in range(2)}  # 2 MiB each: the staging populates new buffers
optimizer = {"state": {0: {"exp_avg": torch.randn(1 << 19)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
before = set(sys.modules)
report = nxd.save_checkpoint(sys.argv[1], "step_1", model=model, optimizer=optimizer, async_save=True)
imported = sorted(set(sys.modules) - before)
nxd.finalize_checkpoint()
assert report.completed and report.staging_allocated_bytes > 0
print("IMPORTED", [m for m in imported if m.split(".")[0] == "nxd_ckpt"])
"""
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED []", proc.stdout[-3000:]
    assert nxd.latest_checkpoint_tag(tmp_path) == "step_1"


_MYPY_CONFIG = """[mypy]
follow_imports = silent
ignore_missing_imports = True
[mypy-torch.*,torch_xla.*,numpy.*,boto3.*,botocore.*]
follow_imports = skip
"""


def _mypy_or_fail() -> None:
    """mypy is in the ``test`` extra: missing in the CPU lane is a broken environment (fail, saying how to fix it);
    the XLA lane may run without it (skip, with the reason)."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        reason = "mypy is not installed: it is in the `test` extra (scripts/setup_env.sh reinstalls it)"
        if os.environ.get("NXD_CKPT_TEST_LANE") == "xla":
            pytest.skip(reason)
        pytest.fail(f"{reason}; or run `{sys.executable} -m pip install mypy`")


def test_a_type_checker_sees_the_signatures(tmp_path):
    """A user's script that misspells a keyword of save_checkpoint is reported by mypy (the signatures are written
    out, not built at run time), and the same call spelled right is not."""
    _mypy_or_fail()
    (tmp_path / "typo.py").write_text('import nxd_ckpt\nnxd_ckpt.save_checkpoint("/tmp/ckpt", "s1", use_xsr=True)\n')
    (tmp_path / "right.py").write_text('import nxd_ckpt\nnxd_ckpt.save_checkpoint("/tmp/ckpt", "s1", use_xser=True)\n')
    (tmp_path / "mypy.ini").write_text(_MYPY_CONFIG)
    root = os.path.dirname(os.path.dirname(os.path.abspath(nxd.__file__)))  # the nxd_ckpt under test
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".mypy_cache"]
    result = subprocess.run(
        [*command, "right.py", "typo.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    expected = 'typo.py:2: error: Unexpected keyword argument "use_xsr" for "save_checkpoint"'
    assert len(errors) == 1 and errors[0].startswith(expected), result.stdout + result.stderr


def test_the_package_says_it_is_typed():
    """PEP 561: an installed nxd_ckpt is type-checked only with a ``py.typed`` beside it, so the wheel ships one."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package = os.path.dirname(os.path.abspath(nxd.__file__))
    assert os.path.isfile(os.path.join(package, "py.typed"))
    with open(os.path.join(os.path.dirname(package), "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["nxd_ckpt"]
