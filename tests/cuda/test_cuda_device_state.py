"""Native accelerator state (CUDA): async saves snapshot on the device and copy to pinned host buffers on a side
stream beside training; loads stream through pinned buffers onto the live tensors. Skipped without a GPU; run on a
GPU machine with ``python -m pytest tests/cuda``."""

from __future__ import annotations

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.fakes import assert_state_equal
from nxd_ckpt.testing.held_transfer import HeldTransfer, host_copy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def _training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 512)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x = torch.randn(64, 512, generator=g).cuda(non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save_during_training(tmp_path, monkeypatch, use_xser: bool, **keywords) -> nxd.SaveReport:
    model, opt = _training()
    _steps(model, opt, 3, seed=1)
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    gate = HeldTransfer(monkeypatch)
    report = nxd.save_checkpoint(
        str(tmp_path), "step_3", model=model, optimizer=opt, async_save=True, use_xser=use_xser, **keywords
    )
    try:
        _steps(model, opt, 5, seed=2)  # kernels that update every tensor in place, enqueued right after the call
        torch.cuda.synchronize()
    finally:
        gate.release()
    report.wait()
    nxd.finalize_checkpoint()
    model2, opt2 = _training()
    _steps(model2, opt2, 1, seed=9)
    nxd.load_checkpoint(str(tmp_path), "step_3", model=model2, optimizer=opt2)
    assert_state_equal(host_copy(model2.state_dict()), expected_model)
    assert_state_equal(host_copy(opt2.state_dict())["state"], expected_opt["state"])
    return report


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_async_save_of_cuda_state_holds_the_call_while_training_goes_on(tmp_path, monkeypatch, use_xser):
    report = _save_during_training(tmp_path, monkeypatch, use_xser)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0


def test_a_budget_smaller_than_the_state_copies_the_rest_on_a_side_stream_training_waits_for(tmp_path, monkeypatch):
    model, _ = _training()
    budget = sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 2
    report = _save_during_training(tmp_path, monkeypatch, True, device_snapshot_budget=budget)
    assert 0 < report.device_snapshot_bytes <= budget and report.device_direct_bytes > 0


def test_pinned_buffers_are_kept_across_saves_and_freed_by_finalize(tmp_path):
    manager = CheckpointManager()
    model, opt = _training()
    _steps(model, opt, 1, seed=1)
    report = manager.save(str(tmp_path), "step_1", model=model, optimizer=opt, async_save=True).wait()
    pool = manager._staging_pool.pinned
    first = pool.allocated_bytes
    assert first > 0 and pool.held_bytes == first and report.staging_allocated_bytes >= first
    _steps(model, opt, 1, seed=2)
    report = manager.save(str(tmp_path), "step_2", model=model, optimizer=opt, async_save=True).wait()
    assert pool.allocated_bytes == first and report.staging_allocated_bytes < 1024, "the second save pinned memory"
    manager.finalize()
    assert pool.held_bytes == 0


def test_load_into_live_cuda_tensors_keeps_them_and_is_exact(tmp_path):
    model, opt = _training()
    _steps(model, opt, 2, seed=1)
    nxd.save_checkpoint(str(tmp_path), "step_2", model=model, optimizer=opt, use_xser=True)
    expected = host_copy(model.state_dict())
    model2, opt2 = _training()
    pointers = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    nxd.load_checkpoint(str(tmp_path), "step_2", model=model2, optimizer=opt2)
    assert {k: v.data_ptr() for k, v in model2.state_dict().items()} == pointers
    assert_state_equal(host_copy(model2.state_dict()), expected)
    _steps(model2, opt2, 1, seed=3)  # the loaded optimizer state trains on
