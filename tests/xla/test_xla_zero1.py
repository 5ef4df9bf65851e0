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
from nxd_ckpt.tree import iter_tensors, map_tensors

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


def _cpu(state):
    """A CPU copy of a (nested) state: training continues in place on the XLA tensors."""
    return map_tensors(state, lambda t: t.detach().cpu().clone())


def _shards(opt) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for g in opt.base_optimizer.param_groups for p in g["params"]]


def _continue(model: torch.nn.Module, opt, steps: int, seed: int) -> list[float]:
    """Train on from a (loaded) state. Gradients are not part of a checkpoint: a resumed model starts with
    ``.grad`` None where the run that never stopped has zero tensors (ZeroRedundancyOptimizer.zero_grad keeps
    them), and ``0 + grad`` vs ``grad`` are two different XLA programs whose float rounding may differ with the
    CPU. Both runs drop their gradients first, so both compile the same programs."""
    opt.zero_grad(set_to_none=True)
    return _steps(model, opt, steps, seed)


@pytest.mark.parametrize("save_master_weights", [True, False], ids=["master_weights", "no_master_weights"])
def test_zero1_resume_is_bit_identical(tmp_path, save_master_weights):
    """What the library guarantees, on any machine: the loaded state equals the saved state bit for bit, and
    training after the resume is bit-identical to training on from that same state in memory.

    Without saved master weights torch_xla rebuilds the fp32 master shards from the saved parameters
    (``init_zero`` in ``load_state_dict``): equal to the lost ones only where the parameters are exact copies of
    them (fp32 parameters and optimizer). The reference therefore applies the same state in memory, and both runs
    start with the same (no) gradients; comparing with a run whose step compiles another XLA program would test
    the CPU's rounding, not the checkpoint. See docs/zero1.md and docs/xla.md.
    """
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
    saved_model, saved_opt = _cpu(model.state_dict()), _cpu(saved_state)
    assert_state_equal(on_disk, saved_opt)
    saved_params = [saved_model[name] for name, _ in model.named_parameters()]

    # The reference: the saved state applied in memory (what a resume reproduces), then 4 more steps.
    opt.load_state_dict(opt.state_dict())
    if save_master_weights:  # the state is unchanged by the round trip
        assert_state_equal(_cpu(model.state_dict()), saved_model)
        assert_state_equal(_shards(opt), [saved_opt["sharded_master_weights"][i] for i in range(len(saved_params))])
    reference = _continue(model, opt, 4, seed=2)

    model2, opt2 = _make(seed=7, save_master_weights=save_master_weights)
    nxd.load_checkpoint(str(tmp_path), "step_3", model=model2, optimizer=opt2)
    assert {t.device.type for t in model2.state_dict().values()} == {"xla"}
    loaded = opt2.state_dict()
    assert loaded["base_state"][0]["exp_avg"].device.type == "xla"
    # Loaded state == saved state, bit for bit.
    assert_state_equal(_cpu(model2.state_dict()), saved_model)
    assert_state_equal(_cpu(loaded["base_state"]), saved_opt["base_state"])
    if save_master_weights:
        assert loaded["sharded_master_weights"][0].device.type == "xla"
        assert_state_equal(_shards(opt2), [saved_opt["sharded_master_weights"][i] for i in range(len(saved_params))])
    else:  # torch_xla rebuilt the master shards from the loaded parameters (DP=1: the whole tensors)
        assert_state_equal(_shards(opt2), saved_params)

    assert _continue(model2, opt2, 4, seed=2) == reference
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), opt.state_dict())
