"""File-level xser interop with the real torch_xla (XLA lane): nested states written by nxd_ckpt load with
``torch_xla.utils.serialization.load``, files written by its ``save`` load with nxd_ckpt (also in a process that
cannot import torch_xla), and the reference files' pickles are identical."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from nxd_ckpt import statefile
from nxd_ckpt.serialization import xser as ours
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla

torch_xla = pytest.importorskip("torch_xla")
txser = pytest.importorskip("torch_xla.utils.serialization")

PATH = "t/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


@pytest.fixture(autouse=True)
def _a_file_per_tensor(monkeypatch):
    """A file per tensor, like torch_xla's save of XLA tensors (tests that want inlining re-enable it)."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")


def _nested(device: torch.device | str) -> dict:
    torch.manual_seed(0)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    shared = torch.randn(2, 2)
    state = {
        "w": torch.randn(4, 3),
        "shared_a": shared,
        "shared_b": shared,
        "row": base[1],
        "dtypes": [torch.randn(3).to(torch.bfloat16), torch.arange(4, dtype=torch.int32), torch.tensor(1.5)],
        "empty": torch.empty(0, 2),
        "pair": (torch.ones(2), "tag", 3),
        "meta": {"step": 5, "betas": (0.9, 0.99)},
    }
    if device == "cpu":
        return state
    moved: dict = {}
    cache: dict[int, torch.Tensor] = {}

    def to(t: torch.Tensor) -> torch.Tensor:
        return cache.setdefault(id(t), t.contiguous().to(device))

    from nxd_ckpt.tree import map_tensors

    moved = map_tensors(state, to)
    torch_xla.sync()
    return moved


def _lists(obj):
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj


def _pickle_of(path: str) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("inline", ["0", str(64 << 10)])
def test_our_files_load_with_torch_xla(tmp_path, monkeypatch, inline):
    """With a file per tensor, and with small tensors kept in the reference file (nxd_ckpt's default)."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", inline)
    state = _nested("cpu")
    statefile.write_state_file(LocalStorage(tmp_path), PATH, state, xser_encoding=True)
    loaded = txser.load(str(tmp_path / PATH))
    assert_state_equal(_lists(loaded), _lists(state))
    assert loaded["shared_a"] is loaded["shared_b"]


def test_torch_xla_files_load_with_ours_and_pickles_match(tmp_path):
    xla_state = _nested(torch_xla.device())
    xla_state["inline_cpu"] = torch.arange(3)  # torch_xla keeps CPU tensors inside the reference file
    target = tmp_path / "theirs" / PATH
    os.makedirs(target.parent)
    txser.save(xla_state, str(target))
    assert not os.path.exists(str(target) + ".info.pt")
    loaded = statefile.read_state_file(LocalStorage(tmp_path / "theirs"), PATH)
    expected = _lists(_nested("cpu")) | {"inline_cpu": [0, 1, 2]}
    got = _lists(loaded)
    got["inline_cpu"] = loaded["inline_cpu"].tolist()
    assert_state_equal(got, expected)

    # The same structure written by nxd_ckpt (references built from torch_xla's real class now that it is
    # imported) has a byte-identical reference pickle. Tuples are left out: torch_xla turns them into lists
    # in the file, nxd_ckpt keeps them (torch_xla's load returns lists either way).
    assert ours.reference_class() is txser.TensorReference

    def without_tuples(state: dict) -> dict:
        return {k: v for k, v in state.items() if k not in ("pair", "meta")}

    mine = tmp_path / "ours" / PATH
    statefile.write_state_file(
        LocalStorage(tmp_path / "ours"), PATH, without_tuples(_nested("cpu")), xser_encoding=True
    )
    theirs_again = tmp_path / "theirs2" / PATH
    os.makedirs(theirs_again.parent)
    txser.save(without_tuples(_nested(torch_xla.device())), str(theirs_again))
    assert _pickle_of(str(mine)) == _pickle_of(str(theirs_again))
    for tid in range(6):
        assert torch.equal(
            torch.load(f"{mine}.tensors/tensor_{tid}.pt", weights_only=True),
            torch.load(f"{theirs_again}.tensors/tensor_{tid}.pt", weights_only=True),
        )


def test_torch_xla_files_load_where_torch_xla_cannot_be_imported(tmp_path):
    """The offline conversion box / Inf2 host case: a torch_xla-written file, a reader without torch_xla."""
    target = tmp_path / PATH
    os.makedirs(target.parent)
    txser.save({"a": torch.ones(2, 3).to(torch_xla.device()), "b": [7]}, str(target))
    script = f"""
import sys
sys.modules["torch_xla"] = None
from nxd_ckpt import statefile
from nxd_ckpt.storage import LocalStorage
s = statefile.read_state_file(LocalStorage({str(tmp_path)!r}), {PATH!r})
assert s["a"].tolist() == [[1.0] * 3] * 2 and s["b"] == [7]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_stand_in_pickles_exactly_like_torch_xla(tmp_path):
    """Written where torch_xla is not importable, the reference pickle still equals torch_xla's own."""
    theirs = tmp_path / "theirs.pt"
    xla = torch_xla.device()
    a = torch.ones(2).to(xla)
    txser.save({"a": a, "again": a, "b": [torch.zeros(1).to(xla), 4]}, str(theirs))
    script = f"""
import sys
sys.modules["torch_xla"] = None
import torch
from nxd_ckpt import statefile
from nxd_ckpt.storage import LocalStorage
a = torch.ones(2)
statefile.write_state_file(LocalStorage({str(tmp_path)!r}), "ours.pt", {{"a": a, "again": a, "b": [torch.zeros(1), 4]}},
                           xser_encoding=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _pickle_of(str(tmp_path / "ours.pt")) == _pickle_of(str(theirs))
