"""The native-accelerator design (device snapshot, pinned buffers, side streams, loads through pinned arenas) on
the fake accelerator of ``harness.fake_accelerator``: copies queued on a side stream run only once an event after
them is waited for, so a path that reads a buffer early, reuses one still being copied, or lets training update a
source before its copy ran loads other bytes than it saved. Each scenario (``harness.native_state``, the CUDA tests'
own) runs in a spawned process, since a backend registered in Python cannot be removed. Transfer chunks and load
arenas of 256 KiB, the size of the model's largest tensors, make every buffer be reused many times."""

from __future__ import annotations

import pytest
import torch
import torch.utils.backend_registration as backend_registration

import nxd_ckpt as nxd
from harness.held_transfer import host_copy
from harness.multiprocess import run_with_ranks
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
    reason=f"torch {torch.__version__} cannot register a backend written in Python (torch >= 2.10 can)",
)

SMALL_BUFFERS = {"NXD_CKPT_XLA_TRANSFER_BATCH_BYTES": str(256 << 10)}
WIDTH = 128
"""The model's widest tensors are 4 x 128 x 128 fp32: 256 KiB, one load arena each."""


def _fake() -> str:
    from harness import fake_accelerator

    fake_accelerator.install()
    return fake_accelerator.DEVICE_TYPE


@run_with_ranks(1)
def test_the_fake_runs_side_stream_copies_only_once_an_event_after_them_is_waited_for():
    from nxd_ckpt.device.backend import NativeDevice

    device = NativeDevice(torch.device(_fake()))
    source = torch.arange(8.0).to(device.device)
    host = device.pinned_empty((8,), torch.float32)
    assert torch.isnan(host).all()  # marked until a copy lands
    side = device.new_stream()
    with device.on(side):
        host.copy_(source, non_blocking=True)
    with torch.no_grad():
        source.add_(100)  # training's next kernel, on the training stream: runs at once
    done = device.record(side)
    assert torch.isnan(host).all() and not done.query()
    done.synchronize()
    assert torch.equal(host, torch.arange(8.0) + 100), "the copy read its source when it ran, not when queued"
    device.current_stream().wait_event(device.record(side))  # nothing left: no-op
    back = torch.zeros(8).to(device.device)
    with device.on(side):
        back.copy_(host, non_blocking=True)
    assert torch.equal(back.cpu(), torch.zeros(8))
    device.current_stream().wait_event(device.record(side))
    assert torch.equal(back.cpu(), host)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@run_with_ranks(1, env=SMALL_BUFFERS)
def test_async_save_of_accelerator_state_holds_the_call_while_training_goes_on(tmp_path, use_xser):
    from harness import native_state

    with native_state.patched() as monkeypatch:
        report = native_state.save_during_training(str(tmp_path), monkeypatch, _fake(), use_xser, width=WIDTH)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_a_budget_smaller_than_the_state_copies_the_rest_on_a_side_stream_training_waits_for(tmp_path):
    from harness import native_state

    device = _fake()
    budget = native_state.state_bytes(device, WIDTH) // 2
    with native_state.patched() as monkeypatch:  # the transfer thread waits: only training's wait runs the copies
        report = native_state.save_during_training(
            str(tmp_path), monkeypatch, device, True, hold="thread", width=WIDTH, device_snapshot_budget=budget
        )
    assert 0 < report.device_snapshot_bytes <= budget and report.device_direct_bytes > 0


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_a_save_whose_snapshot_fits_on_the_device_makes_its_side_stream_off_the_training_thread(tmp_path):
    from harness import native_state

    native_state.snapshot_that_fits_makes_no_stream_in_the_call(str(tmp_path), _fake(), WIDTH)


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_pinned_buffers_are_kept_across_saves_and_freed_by_finalize(tmp_path):
    from harness import native_state

    native_state.pinned_buffers_are_kept_across_saves(str(tmp_path), _fake(), WIDTH)


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_a_load_fills_the_live_accelerator_tensors_through_reused_arenas_and_is_exact(tmp_path):
    from harness import native_state

    native_state.load_into_live_tensors(str(tmp_path), _fake(), WIDTH)


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_under_a_host_memory_budget_the_call_snapshots_and_the_copies_travel_beside_training(tmp_path):
    from harness import native_state

    device = _fake()
    budget = native_state.state_bytes(device, WIDTH) // 4
    with native_state.patched() as monkeypatch:
        report = native_state.save_during_training(
            str(tmp_path), monkeypatch, device, True, width=WIDTH, host_memory_budget=budget
        )
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_budgeted_saves_copy_into_one_pinned_arena_that_they_reuse(tmp_path):
    from harness import native_state

    native_state.budgeted_saves_reuse_one_pinned_arena(str(tmp_path), _fake(), WIDTH)


@run_with_ranks(1, env=SMALL_BUFFERS)
def test_a_budgeted_save_whose_write_fails_frees_the_transfer_thread_for_the_next_save(tmp_path):
    """The write fails at once: the save reports it, and the copies it had not brought yet do not keep the
    process's transfer thread, so the next budgeted save completes and holds its call's state."""
    from harness import native_state
    from nxd_ckpt.errors import AsyncSaveError
    from nxd_ckpt.save import write

    device = _fake()
    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1)
    budget = native_state.state_bytes(device, WIDTH) // 2
    real_write_files = write.write_files

    def failing(*args, **kwargs):
        raise OSError("disk full (injected)")

    with native_state.patched() as monkeypatch:
        monkeypatch.setattr(write, "write_files", failing)
        failed = nxd.save_checkpoint(str(tmp_path), "step_1", model=model, optimizer=opt, async_save=True,
                                     host_memory_budget=budget)  # fmt: skip
        with pytest.raises(Exception, match="disk full"):
            failed.wait()
        monkeypatch.setattr(write, "write_files", real_write_files)
    with pytest.raises(AsyncSaveError, match="disk full"):  # the failure again, raised once by the next save
        nxd.save_checkpoint(str(tmp_path), "step_2", model=model, optimizer=opt, async_save=True,
                            host_memory_budget=budget)  # fmt: skip
    expected = host_copy(model.state_dict())
    report = nxd.save_checkpoint(str(tmp_path), "step_2", model=model, optimizer=opt, async_save=True,
                                 host_memory_budget=budget)  # fmt: skip
    native_state.steps(model, opt, 2, seed=2)
    report.wait()
    nxd.finalize_checkpoint()
    assert report.completed and report.device_snapshot_bytes > 0
    loaded, _ = native_state.training(device, WIDTH)
    nxd.load_checkpoint(str(tmp_path), "step_2", model=loaded)
    assert_state_equal(host_copy(loaded.state_dict()), expected)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@run_with_ranks(1)
def test_tied_weights_are_cloned_and_moved_once_and_written_as_a_sync_save_writes_them(tmp_path, use_xser):
    from harness import tied_weights
    from harness.native_state import patched

    with patched() as monkeypatch:
        report = tied_weights.saved_once_and_loaded_tied(str(tmp_path), _fake(), monkeypatch, use_xser)
    assert report.device_direct_bytes == 0


@run_with_ranks(1)
def test_tied_weights_under_a_host_memory_budget_are_cloned_and_moved_once(tmp_path):
    from harness import tied_weights
    from harness.native_state import patched

    with patched() as monkeypatch:
        report = tied_weights.saved_once_and_loaded_tied(
            str(tmp_path), _fake(), monkeypatch, True, host_memory_budget="4MiB"
        )
    assert report.device_direct_bytes == 0 and report.budget_peak_bytes <= 4 << 20


@run_with_ranks(1)
def test_a_stuck_transfer_makes_the_next_save_raise_at_its_deadline_and_loses_nothing(tmp_path):
    from harness import native_state

    native_state.stuck_transfer_fails_at_the_deadline(str(tmp_path), _fake())


@run_with_ranks(1, timeout=120)
def test_a_thousand_async_saves_hold_no_more_device_memory_pinned_memory_threads_or_files(tmp_path):
    from harness import soak

    with soak.memory_dir(tmp_path) as path:  # fsyncs cost nothing there: the saves' own work is what is measured
        measures = soak.saves_hold_nothing(path, _fake(), saves=1000, every=100)
    assert measures[0].device > 0 and measures[0].pinned > 0  # the measures see the state and its buffers
