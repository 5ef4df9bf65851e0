"""Save and load through the public API with state on the XLA CPU device: where tensors land, exact resume."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps
from nxd_ckpt.tree import iter_tensors

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


def _devices(tree) -> set[str]:
    return {t.device.type for _, t in iter_tensors(tree)}


def _optimizer_state_devices(opt: torch.optim.Optimizer) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for per_param in opt.state_dict()["state"].values():
        for key, value in per_param.items():
            out.setdefault(key, set()).add(value.device.type)
    return out


@pytest.mark.parametrize("async_save", [False, True])
def test_model_and_optimizer_on_xla_round_trip_and_resume_exactly(tmp_path, async_save):
    device = torch_xla.device()
    model, opt, sched = make_training(seed=3, device=device)
    train_steps(model, opt, sched, 3, seed=3)
    expected_model = {k: v.cpu() for k, v in model.state_dict().items()}
    report = nxd.save_checkpoint(
        str(tmp_path), "step_3", model=model, optimizer=opt, scheduler=sched, async_save=async_save
    )
    reference = train_steps(model, opt, sched, 3, seed=4)  # training goes on while an async save writes
    report.wait()
    nxd.finalize_checkpoint()

    saved = torch.load(tmp_path / "step_3" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert _devices(saved) == {"cpu"}  # files hold host tensors: NxD and CPU-only readers load them
    assert_state_equal(saved, expected_model)

    model2, opt2, sched2 = make_training(seed=9, device=device)
    nxd.load_checkpoint(str(tmp_path), "step_3", model=model2, optimizer=opt2, scheduler=sched2)
    assert _devices(model2.state_dict()) == {"xla"}
    assert _optimizer_state_devices(opt2) == {"step": {"cpu"}, "exp_avg": {"xla"}, "exp_avg_sq": {"xla"}}
    assert_state_equal(model2.state_dict(), expected_model)
    assert train_steps(model2, opt2, sched2, 3, seed=4) == reference
    assert_state_equal(model2.state_dict(), model.state_dict())
    assert_state_equal(opt2.state_dict(), opt.state_dict())


def test_dict_targets_get_cpu_tensors_unless_a_device_is_asked_for(tmp_path):
    model, opt, sched = make_training(device=torch_xla.device())
    train_steps(model, opt, sched, 1, seed=1)
    nxd.save_checkpoint(str(tmp_path), "t", model=model, optimizer=opt)
    on_cpu, on_xla, optim_on_xla = {}, {}, {}
    nxd.load_checkpoint(str(tmp_path), model=on_cpu)
    nxd.load_checkpoint(str(tmp_path), model=on_xla, optimizer=optim_on_xla, device="xla")
    assert _devices(on_cpu) == {"cpu"}
    assert _devices(on_xla) == {"xla"} and {t.device for t in on_xla.values()} == {torch_xla.device()}
    assert _devices(optim_on_xla["state"]) == {"xla"}
    assert_state_equal(on_cpu, on_xla)
    assert_state_equal(on_cpu, model.state_dict())


def test_checkpoint_of_xla_tensors_loads_as_cpu_tensors_without_torch_xla(tmp_path):
    model, opt, sched = make_training(device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=5)
    nxd.save_checkpoint(str(tmp_path), "t", model=model, optimizer=opt, scheduler=sched)
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(expected, tmp_path / "expected.pt")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch_xla"] = None  # as on a machine without torch_xla: importing it fails
        import torch
        import nxd_ckpt as nxd
        from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal
        state, optim = {{}}, {{}}
        nxd.load_checkpoint({str(tmp_path)!r}, model=state, optimizer=optim)
        cpu_model = TinyMLP()
        nxd.load_checkpoint({str(tmp_path)!r}, model=cpu_model)
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        assert_state_equal(state, expected)
        assert_state_equal(cpu_model.state_dict(), expected)
        assert all(t.device.type == "cpu" for s in optim["state"].values() for t in s.values())
        try:
            nxd.load_checkpoint({str(tmp_path)!r}, model={{}}, device="xla")
        except nxd.DeviceUnavailableError as e:
            assert "torch_xla" in str(e)
        else:
            raise AssertionError("device='xla' without torch_xla did not raise")
        """
    )
    env_free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert env_free.returncode == 0, env_free.stderr[-3000:]
