"""xser interop with the real torch_xla through the public API: checkpoints saved with ``use_xser=True`` load
with ``xser.load``, and tags written with ``xser.save`` (as NxD writes them) load with ``load_checkpoint`` into a
model on the XLA device. (File-level interop is tests/xla/test_xla_xser_files.py.)"""

from __future__ import annotations

import os

import pytest

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)
xser = pytest.importorskip("torch_xla.utils.serialization", reason=XLA_LANE_ONLY)

STATE_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _as_lists(obj):
    """xser.load returns tuples as lists; compare after the same conversion."""
    if isinstance(obj, dict):
        return {k: _as_lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_as_lists(v) for v in obj]
    return obj


def test_nxd_ckpt_xser_files_load_with_torch_xla(tmp_path):
    model, opt, sched = make_training(seed=2, device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=2)
    nxd.save_checkpoint(str(tmp_path), "x", model=model, optimizer=opt, use_xser=True)
    loaded_model = xser.load(str(tmp_path / "x" / "model" / STATE_FILE))
    loaded_optim = xser.load(str(tmp_path / "x" / "optim" / STATE_FILE))
    assert {t.device.type for t in loaded_model.values()} == {"cpu"}
    assert_state_equal(loaded_model, model.state_dict())
    assert_state_equal(_as_lists(loaded_optim), _as_lists(opt.state_dict()))


def test_files_written_by_torch_xla_xser_load_into_a_model_on_xla(tmp_path):
    """An NxD-style tag written with torch_xla's own ``xser.save`` (no nxd_ckpt metadata)."""
    model, opt, sched = make_training(seed=4, device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=4)
    tag = tmp_path / "step_2"
    for sub in ("model", "optim"):
        os.makedirs(tag / sub)
    (tag / "checkpoint").write_bytes(b"1")
    xser.save(model.state_dict(), str(tag / "model" / STATE_FILE))
    xser.save(opt.state_dict(), str(tag / "optim" / STATE_FILE))
    (tag / "done").write_bytes(b"1")
    assert os.path.isdir(str(tag / "model" / STATE_FILE) + ".tensors")

    model2, opt2, sched2 = make_training(seed=8, device=torch_xla.device())
    nxd.load_checkpoint(str(tmp_path), "step_2", model=model2, optimizer=opt2)
    assert {t.device.type for t in model2.state_dict().values()} == {"xla"}
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert train_steps(model2, opt2, sched2, 2, seed=5) == train_steps(model, opt, sched, 2, seed=5)
