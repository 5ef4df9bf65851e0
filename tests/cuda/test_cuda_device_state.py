"""Native accelerator state (CUDA): async saves snapshot on the device and copy to pinned host buffers on a side
stream beside training; loads stream through pinned buffers onto the live tensors. Skipped without a GPU; run on a
GPU machine with ``python -m pytest tests/cuda``. The same scenarios (``harness.native_state``) run on the fake
accelerator in every lane that can register one (tests/unit/device/test_fake_accelerator.py)."""

from __future__ import annotations

import pytest
import torch

from harness import native_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_async_save_of_cuda_state_holds_the_call_while_training_goes_on(tmp_path, monkeypatch, use_xser):
    report = native_state.save_during_training(str(tmp_path), monkeypatch, "cuda", use_xser)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0


def test_a_budget_smaller_than_the_state_copies_the_rest_on_a_side_stream_training_waits_for(tmp_path, monkeypatch):
    budget = native_state.state_bytes("cuda") // 2
    report = native_state.save_during_training(
        str(tmp_path), monkeypatch, "cuda", True, hold="thread", device_snapshot_budget=budget
    )
    assert 0 < report.device_snapshot_bytes <= budget and report.device_direct_bytes > 0


def test_a_save_whose_snapshot_fits_on_the_device_makes_its_side_stream_off_the_training_thread(tmp_path):
    native_state.snapshot_that_fits_makes_no_stream_in_the_call(str(tmp_path), "cuda")


def test_pinned_buffers_are_kept_across_saves_and_freed_by_finalize(tmp_path):
    native_state.pinned_buffers_are_kept_across_saves(str(tmp_path), "cuda")


def test_load_into_live_cuda_tensors_keeps_them_and_is_exact(tmp_path):
    native_state.load_into_live_tensors(str(tmp_path), "cuda")


def test_under_a_host_memory_budget_the_call_snapshots_and_the_copies_travel_beside_training(tmp_path, monkeypatch):
    budget = native_state.state_bytes("cuda") // 4
    report = native_state.save_during_training(str(tmp_path), monkeypatch, "cuda", True, host_memory_budget=budget)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0


def test_budgeted_saves_copy_into_one_pinned_arena_that_they_reuse(tmp_path):
    native_state.budgeted_saves_reuse_one_pinned_arena(str(tmp_path), "cuda")
