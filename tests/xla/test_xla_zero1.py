"""torch_xla's real ZeroRedundancyOptimizer through save_checkpoint/load_checkpoint: bit-identical resume.

On XLA:CPU it cannot shard across processes (each process is a world of one), so this runs in one process; the
sharded-state code path (``base_state``, ``shape_info``, ``sharded_master_weights``) is the real one.
"""

from __future__ import annotations

import json

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal
from nxd_ckpt.tree import iter_tensors

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)
zero_module = pytest.importorskip("torch_xla.distributed.zero_redundancy_optimizer", reason=XLA_LANE_ONLY)


def _make(seed: int, save_master_weights: bool):
    torch.manual_seed(seed)
    model = TinyMLP().to(torch_xla.device())
    opt = zero_module.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=save_master_weights
    )
    return model, opt


def _steps(model: torch.nn.Module, opt, steps: int, seed: int) -> list[float]:
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x = torch.randn(16, 8, generator=g).to(torch_xla.device())
        y = torch.randn(16, 4, generator=g).to(torch_xla.device())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
    return losses


@pytest.mark.parametrize("save_master_weights", [True, False], ids=["master_weights", "no_master_weights"])
def test_zero1_resume_is_bit_identical(tmp_path, save_master_weights):
    model, opt = _make(seed=0, save_master_weights=save_master_weights)
    _steps(model, opt, 3, seed=1)
    saved_state = opt.state_dict()
    assert ("sharded_master_weights" in saved_state) is save_master_weights
    assert saved_state["base_state"][0]["exp_avg"].device.type == "xla"

    nxd.save_checkpoint(str(tmp_path), "step_3", model=model, optimizer=opt)
    meta = json.loads((tmp_path / "step_3" / "nxd_ckpt.json").read_text())
    assert meta["zero1"] is True  # recognised by class through sys.modules
    on_disk = torch.load(tmp_path / "step_3" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert {t.device.type for _, t in iter_tensors(on_disk)} == {"cpu"}
    assert set(on_disk) >= {"base_state", "shape_info", "param_groups"}

    reference = _steps(model, opt, 4, seed=2)

    model2, opt2 = _make(seed=7, save_master_weights=save_master_weights)
    nxd.load_checkpoint(str(tmp_path), "step_3", model=model2, optimizer=opt2)
    assert {t.device.type for t in model2.state_dict().values()} == {"xla"}
    loaded = opt2.state_dict()
    assert loaded["base_state"][0]["exp_avg"].device.type == "xla"
    if save_master_weights:
        assert loaded["sharded_master_weights"][0].device.type == "xla"

    assert _steps(model2, opt2, 4, seed=2) == reference
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), opt.state_dict())
