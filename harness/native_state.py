"""Scenarios for training state on a native accelerator, shared by the CUDA tests (on a GPU) and the fake
accelerator's (``harness.fake_accelerator``, anywhere): a small model and AdamW on ``device``, async saves with
optimizer steps right after the call, pinned buffers kept across saves, loads into the live tensors."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

import torch

import nxd_ckpt as nxd
from harness.held_transfer import HeldTransfer, host_copy
from nxd_ckpt.device.backend import NativeDevice
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.fakes import assert_state_equal

WIDTH = 512


def training(device: str, width: int = WIDTH) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every call (seeded), on ``device``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Tanh(), torch.nn.Linear(4 * width, width))
    model = model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, count: int, seed: int, *, autograd: bool = True) -> None:
    """``count`` optimizer steps on batches drawn from ``seed``: every parameter and moment changes in place. Without
    ``autograd`` the gradients are drawn too (a backend written in Python has one device for the autograd engine:
    backward on its device 1 fails)."""
    device = next(model.parameters()).device
    width = next(model.parameters()).shape[1]
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        if not autograd:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(device)
            opt.step()
            continue
        x = torch.randn(64, width, generator=g).to(device, non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def synchronize(device: str) -> None:
    """Wait for every stream of ``device``."""
    NativeDevice(torch.device(device)).module.synchronize()


@contextlib.contextmanager
def patched() -> Iterator[Any]:
    """A pytest ``MonkeyPatch`` for code that runs outside a fixture (a spawned rank)."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        yield monkeypatch


def save_during_training(
    path: str,
    monkeypatch: Any,
    device: str,
    use_xser: bool,
    *,
    hold: str = "chunks",
    width: int = WIDTH,
    **keywords: Any,
) -> nxd.SaveReport:
    """An async save, 5 optimizer steps while its transfer is held (``HeldTransfer``), then a load into a fresh
    model after a step of its own: it must hold the state of the call, bit for bit."""
    model, opt = training(device, width)
    steps(model, opt, 3, seed=1)
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    gate = HeldTransfer(monkeypatch, hold=hold)
    report = nxd.save_checkpoint(
        path, "step_3", model=model, optimizer=opt, async_save=True, use_xser=use_xser, **keywords
    )
    try:
        steps(model, opt, 5, seed=2)  # updates every tensor in place, enqueued right after the call
        synchronize(device)
    finally:
        gate.release()
    report.wait()
    nxd.finalize_checkpoint()
    model2, opt2 = training(device, width)
    steps(model2, opt2, 1, seed=9)
    nxd.load_checkpoint(path, "step_3", model=model2, optimizer=opt2)
    assert_state_equal(host_copy(model2.state_dict()), expected_model)
    assert_state_equal(host_copy(opt2.state_dict())["state"], expected_opt["state"])
    return report


def state_bytes(device: str, width: int = WIDTH) -> int:
    """Bytes of the model's state (what a budget is compared with)."""
    model, _ = training(device, width)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def pinned_buffers_are_kept_across_saves(path: str, device: str, width: int = WIDTH) -> None:
    """The first async save pins host buffers, the second reuses them, ``finalize`` frees them."""
    manager = CheckpointManager()
    model, opt = training(device, width)
    steps(model, opt, 1, seed=1)
    report = manager.save(path, "step_1", model=model, optimizer=opt, async_save=True).wait()
    pool = manager._staging_pool.pinned
    first = pool.allocated_bytes
    assert first > 0 and pool.held_bytes == first and report.staging_allocated_bytes >= first
    steps(model, opt, 1, seed=2)
    report = manager.save(path, "step_2", model=model, optimizer=opt, async_save=True).wait()
    assert pool.allocated_bytes == first and report.staging_allocated_bytes < 1024, "the second save pinned memory"
    manager.finalize()
    assert pool.held_bytes == 0


def load_into_live_tensors(path: str, device: str, width: int = WIDTH) -> None:
    """A load fills the live device tensors in place (same storage), bit for bit, and training goes on."""
    model, opt = training(device, width)
    steps(model, opt, 2, seed=1)
    nxd.save_checkpoint(path, "step_2", model=model, optimizer=opt, use_xser=True)
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    model2, opt2 = training(device, width)
    steps(model2, opt2, 1, seed=5)
    pointers = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    nxd.load_checkpoint(path, "step_2", model=model2, optimizer=opt2)
    assert {k: v.data_ptr() for k, v in model2.state_dict().items()} == pointers
    assert_state_equal(host_copy(model2.state_dict()), expected_model)
    assert_state_equal(host_copy(opt2.state_dict())["state"], expected_opt["state"])
    steps(model2, opt2, 1, seed=3)  # the loaded optimizer state trains on


def budgeted_saves_reuse_one_pinned_arena(path: str, device: str, width: int = WIDTH) -> None:
    """Two async saves under a host memory budget of a third of the state (the model's bytes, twice the largest
    tensor): the copies land in one pinned arena
    of the budget's size, pinned by the first save and reused by the second, every piece given back once its file
    is written and waited for rather than missed; each tag holds the state of its call."""
    manager = CheckpointManager()
    model, opt = training(device, width)
    budget = state_bytes(device, width)  # the optimizer's moments are twice as much again
    arenas, copied_by_writers = [], 0
    for step in (1, 2):
        steps(model, opt, 1, seed=step)
        expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
        report = manager.save(
            path, f"step_{step}", model=model, optimizer=opt, async_save=True, use_xser=True, host_memory_budget=budget
        )
        steps(model, opt, 2, seed=10 + step)  # training goes on while the copies travel
        report.wait()
        assert report.device_snapshot_bytes > 0
        copied_by_writers += report.budget_copied_by_writers_bytes
        arena = manager._staging_pool._arena
        assert arena is not None and arena.capacity == budget and arena.lent_bytes == 0
        arenas.append(arena)
        loaded_model, loaded_opt = training(device, width)
        steps(loaded_model, loaded_opt, 1, seed=9)
        manager.load(path, f"step_{step}", model=loaded_model, optimizer=loaded_opt)
        assert_state_equal(host_copy(loaded_model.state_dict()), expected_model)
        assert_state_equal(host_copy(loaded_opt.state_dict())["state"], expected_opt["state"])
    assert arenas[0] is arenas[1] and arenas[0].allocated_bytes == budget
    # pieces go back as their files are written, and the copies wait for a free run of the arena: only a writer
    # ahead of them, which copies a tensor itself and does not wait, can miss one
    refused = arenas[0].refused_bytes
    assert refused == 0 or copied_by_writers > 0, f"{refused} bytes found no room in the arena"
    manager.finalize()
    assert manager._staging_pool._arena is None


def snapshot_that_fits_makes_no_stream_in_the_call(path: str, device: str, width: int = WIDTH) -> None:
    """A process's first stream costs milliseconds (the backend fills its stream pool): when the whole snapshot fits
    on the device, the save's call makes none, and the transfer thread makes the one its copies run on."""
    made: list[int] = []
    real_new_stream = NativeDevice.new_stream

    def recording(self: NativeDevice) -> Any:
        made.append(threading.get_ident())
        return real_new_stream(self)

    model, opt = training(device, width)
    steps(model, opt, 1, seed=1)
    with patched() as monkeypatch:
        monkeypatch.setattr(NativeDevice, "new_stream", recording)
        report = nxd.save_checkpoint(path, "step_1", model=model, optimizer=opt, async_save=True, use_xser=True)
        in_call = list(made)
        report.wait()
    nxd.finalize_checkpoint()
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0
    assert threading.get_ident() not in in_call, "the save's call made a stream"
    assert made and threading.get_ident() not in made, f"streams made on threads {made}"


def saves_and_loads_on(path: str, device: str, width: int = WIDTH, *, autograd: bool = True) -> None:
    """State on ``device`` (a device other than the calling thread's current one, in the tests): an async save
    through the pinned pool, one under a host memory budget, a load into the live tensors; both tags hold their
    call's state, and the pinned memory is freed at the end. Every background thread of the library moves bytes
    here; where their device work ran is for the caller to check. ``autograd``: as for ``steps``."""
    manager = CheckpointManager()
    model, opt = training(device, width)
    for step, budget in ((1, None), (2, state_bytes(device, width))):
        steps(model, opt, 1, seed=step, autograd=autograd)
        expected = host_copy(model.state_dict()), host_copy(opt.state_dict())["state"]
        report = manager.save(
            path, f"step_{step}", model=model, optimizer=opt, async_save=True, use_xser=True, host_memory_budget=budget
        )
        steps(model, opt, 1, seed=10 + step, autograd=autograd)  # training goes on while the copies travel
        report.wait()
        assert report.device_snapshot_bytes > 0
    manager.load(path, "step_2", model=model, optimizer=opt)  # into the live tensors, through pinned arenas
    assert_state_equal(host_copy(model.state_dict()), expected[0])
    assert_state_equal(host_copy(opt.state_dict())["state"], expected[1])
    manager.finalize()
    gc.collect()  # the pinned buffers the pool and the arena held are dropped (unregistered) here


def stuck_transfer_fails_at_the_deadline(path: str, device: str, timeout_s: float = 2.0) -> None:
    """A transfer that never moves (``HeldTransfer`` holds its job on the transfer thread): the next save raises
    ``CheckpointTimeoutError`` within its deadline, naming the phase and the rank; the stuck save fails at its own
    deadline (its writer waited for the transfer) without ``done``; the previous checkpoint still loads."""
    import time

    from nxd_ckpt.errors import AsyncSaveError, CheckpointTimeoutError

    manager = CheckpointManager()
    model, opt = training(device, 64)
    steps(model, opt, 1, seed=1)
    expected = host_copy(model.state_dict())
    manager.save(path, "good", model=model, optimizer=opt, async_save=True).wait()
    with patched() as monkeypatch:
        gate = HeldTransfer(monkeypatch, timeout_s=60, hold="thread")
        steps(model, opt, 1, seed=2)
        stuck = manager.save(path, "stuck", model=model, optimizer=opt, async_save=True, timeout=timeout_s)
        start = time.monotonic()
        try:
            manager.save(path, "next", model=model, optimizer=opt, async_save=True, timeout=timeout_s)
            raise AssertionError("the save after a stuck one did not raise")
        except CheckpointTimeoutError as e:
            elapsed, message = time.monotonic() - start, str(e)
        assert timeout_s <= elapsed < timeout_s + 8, f"raised after {elapsed:.1f} s"
        assert "waiting for the previous async save on rank 0" in message, message
        try:
            stuck.wait()
            raise AssertionError("the stuck save succeeded")
        except CheckpointTimeoutError as e:
            assert "device-to-host transfer" in str(e) and "on rank 0" in str(e), str(e)
        gate.release()
    try:
        manager.finalize()
        raise AssertionError("finalize did not report the stuck save's failure")
    except AsyncSaveError as e:
        assert isinstance(e.__cause__, CheckpointTimeoutError), repr(e.__cause__)
    assert nxd.latest_checkpoint_tag(path) == "good"
    model2, opt2 = training(device, 64)
    manager = CheckpointManager()
    manager.load(path, "good", model=model2, optimizer=opt2)
    assert_state_equal(host_copy(model2.state_dict()), expected)
