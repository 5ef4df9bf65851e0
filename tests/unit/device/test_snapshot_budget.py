"""The device snapshot budget as one decision (``device.kept_budget``): ``auto`` sized from the training's peak
(nothing on the device without a peak figure), kept from save to save while the free memory shifts, agreed as the
ranks' minimum, shrunk after an out-of-memory in the snapshot, whose rest moves by the direct transfer. The
native accelerator is the fake one (``harness.fake_accelerator``: its memory figures and a clone's allocation
failure are set by the test), in spawned processes; XLA: tests/xla/test_xla_device_snapshot.py."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.utils.backend_registration as backend_registration

from harness.held_transfer import host_copy
from harness.multiprocess import run_with_ranks
from nxd_ckpt.device import backend
from nxd_ckpt.device.kept_budget import KeptSnapshotBudget, agree
from nxd_ckpt.testing.fakes import assert_state_equal

WIDTH = 128
MiB = 1 << 20
fake_only = pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
    reason=f"torch {torch.__version__} cannot register a backend written in Python (torch >= 2.10 can)",
)


def _meta(*sizes: int) -> list[torch.Tensor]:
    return [torch.empty(n, device="meta") for n in sizes]


def test_a_kept_budget_is_measured_once_per_layout_agreed_and_shrunk_after_an_out_of_memory(monkeypatch):
    figures = iter([1000, 10, 10, 10, 400])
    monkeypatch.setattr(backend.SnapshotBudget, "resolve", lambda self, tensors: (next(figures), "measured"))
    kept, auto, state = KeptSnapshotBudget(), backend.SnapshotBudget(None), _meta(10, 20)
    assert kept.proposal(auto, state) == 1000
    assert kept.agree(agree([1000, None, 700])).bytes == 700  # the least of the ranks'
    assert [kept.proposal(auto, state) for _ in range(3)] == [700] * 3  # not measured again
    assert kept.proposal(auto, _meta(10, 21)) == 10  # the shapes changed: measured anew
    assert kept.proposal(backend.SnapshotBudget(5), _meta(10, 21)) == 10  # another budget asked: anew
    assert kept.shrink(cloned_bytes=6) == 3 and kept.proposal(backend.SnapshotBudget(5), _meta(10, 21)) == 3
    assert kept.shrink(cloned_bytes=0) == 1  # nothing cloned: half the budget


def test_a_proposal_has_a_ticket_and_only_the_answer_to_the_current_one_is_kept(monkeypatch):
    """The DCP front end's agreement (one save late, through the plan gather): an answer is taken for the ticket
    it answers, never raises the kept budget, and a shrink or a new layout makes the older answers stale."""
    from nxd_ckpt.device import kept_budget

    figures = iter([1000, 800])
    monkeypatch.setattr(backend.SnapshotBudget, "resolve", lambda self, tensors: (next(figures), "measured"))
    kept, auto = KeptSnapshotBudget(), backend.SnapshotBudget(None)
    kept.proposal(auto, _meta(10))
    first = kept.ticket
    kept_budget.offer(first, kept.bytes)
    assert kept_budget.take_offer() == kept_budget.Offer(first, 1000)
    assert kept_budget.take_offer() is None  # taken once: a later save without a stager's offer carries none
    kept_budget.answer(first, 600)  # the least of the ranks' offers
    kept.take_answer(kept_budget.answer_for(first))
    assert kept.bytes == 600 and kept.proposal(auto, _meta(10)) == 600 and kept.ticket == first
    kept.take_answer(900)  # an answer never raises the kept budget
    assert kept.bytes == 600
    kept.shrink(cloned_bytes=400)
    assert kept.ticket != first and kept.bytes == 200
    kept.take_answer(kept_budget.answer_for(kept.ticket))  # no answer to the shrunk proposal yet
    assert kept.bytes == 200
    kept.proposal(auto, _meta(11))  # a new layout: measured anew, a new ticket
    assert kept.bytes == 800 and kept_budget.answer_for(kept.ticket) is None


def test_a_warm_up_snapshots_within_the_saves_budget_and_leaves_a_peak_sized_auto_to_the_first_save(monkeypatch):
    kept, state = KeptSnapshotBudget(), _meta(10)
    assert kept.for_warm_up(backend.SnapshotBudget(0), state) == backend.SnapshotBudget(0)
    assert kept.proposal(backend.SnapshotBudget(0), state) == 0  # the first save proposes what was warmed
    monkeypatch.setattr(backend.SnapshotBudget, "resolve", lambda self, tensors: (123, backend.SOURCE_PEAK))
    auto = backend.SnapshotBudget(None)
    assert kept.for_warm_up(auto, state) is None  # no training step ran: its peak says nothing yet
    kept.proposal(auto, state)
    kept.agree(100)
    assert kept.for_warm_up(auto, state) == backend.SnapshotBudget(100)  # what the saves agreed on


def _fake() -> str:
    from harness import fake_accelerator

    fake_accelerator.install()
    return fake_accelerator.DEVICE_TYPE


def _set_memory(free: int, peak_over_reserved: int, reserved: int = 64 * MiB) -> int:
    """The fake device's figures: ``free`` in the driver, the allocator's peak ``peak_over_reserved`` above what it
    holds now; returns what ``auto`` then takes (``FREE_FRACTION`` of what the peak left)."""
    from harness import fake_accelerator

    fake_accelerator.FREE_BYTES, fake_accelerator.RESERVED_BYTES = free, reserved
    fake_accelerator.PEAK_RESERVED_BYTES = reserved + peak_over_reserved
    return int((free - peak_over_reserved) * backend.FREE_FRACTION)


def _saved_exactly(manager, path: str, tag: str, model, opt, during_save=contextlib.nullcontext):
    """An async save (inside ``during_save()``), two optimizer steps right after the call, then a load into a
    fresh model that must hold the state of the call; returns the report."""
    from harness import native_state

    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    with during_save():
        report = manager.save(path, tag, model=model, optimizer=opt, async_save=True, use_xser=True)
    native_state.steps(model, opt, 2, seed=len(tag))  # training goes on
    report.wait()
    device = next(model.parameters()).device.type
    loaded, loaded_opt = native_state.training(device, next(model.parameters()).shape[1])
    native_state.steps(loaded, loaded_opt, 1, seed=9)
    manager.load(path, tag, model=loaded, optimizer=loaded_opt)
    assert_state_equal(host_copy(loaded.state_dict()), expected_model)
    assert_state_equal(host_copy(loaded_opt.state_dict())["state"], expected_opt["state"])
    return report


@fake_only
@run_with_ranks(1)
def test_auto_is_sized_from_the_training_peak_and_kept_while_free_memory_shifts(tmp_path):
    from harness import native_state
    from nxd_ckpt.manager import CheckpointManager

    device = _fake()
    model_bytes = native_state.state_bytes(device, WIDTH)
    manager = CheckpointManager()
    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1)
    first_budget = _set_memory(free=256 * MiB, peak_over_reserved=256 * MiB - 2 * model_bytes)
    first = _saved_exactly(manager, str(tmp_path), "s1", model, opt)
    assert first.device_budget_bytes == first_budget  # free memory alone would have held all of it
    assert 0 < first.device_snapshot_bytes <= first_budget and first.device_direct_bytes > 0
    for i, free in enumerate((300 * MiB, 250 * MiB, 260 * MiB)):  # the figures shift between saves
        assert _set_memory(free, peak_over_reserved=free - model_bytes - 4 * i * 4096) != first_budget
        later = _saved_exactly(manager, str(tmp_path), f"s{i + 2}", model, opt)
        assert later.device_budget_bytes == first_budget, "the budget followed a moment's memory figures"
        assert later.device_snapshot_bytes == first.device_snapshot_bytes  # the same tensors cloned
    wider, wider_opt = native_state.training(device, WIDTH * 2)  # new shapes: a new decision, measured now
    native_state.steps(wider, wider_opt, 1, seed=1)
    second_budget = _set_memory(free=256 * MiB, peak_over_reserved=0)
    assert _saved_exactly(manager, str(tmp_path), "wider", wider, wider_opt).device_budget_bytes == second_budget
    manager.finalize()


@fake_only
@run_with_ranks(1)
def test_without_a_peak_figure_auto_takes_no_device_copy_and_the_call_moves_the_state(tmp_path):
    from harness import fake_accelerator, native_state
    from nxd_ckpt.manager import CheckpointManager

    device = _fake()
    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1)
    with native_state.patched() as monkeypatch:
        monkeypatch.delattr(type(getattr(torch, fake_accelerator.DEVICE_TYPE)), "max_memory_reserved")
        manager = CheckpointManager()
        report = _saved_exactly(manager, str(tmp_path), "s1", model, opt)
    assert report.device_budget_bytes == 0 and report.device_snapshot_bytes == 0 and report.device_direct_bytes > 0
    manager.finalize()


@fake_only
@pytest.mark.parametrize("host_memory_budget", [None, "1MiB"], ids=["pooled", "budgeted"])
@run_with_ranks(1)
def test_an_out_of_memory_in_the_snapshot_moves_the_rest_directly_and_the_next_save_fits(tmp_path, host_memory_budget):
    from harness import fake_accelerator, native_state
    from nxd_ckpt.manager import CheckpointManager

    device = _fake()
    _set_memory(free=256 * MiB, peak_over_reserved=0)
    manager = CheckpointManager(host_memory_budget=host_memory_budget)
    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1)
    oom = functools.partial(fake_accelerator.out_of_memory_after, clones=2)  # the device is fuller than the budget
    failed = _saved_exactly(manager, str(tmp_path), "s1", model, opt, during_save=oom)
    assert failed.completed and "ran out of memory" in (failed.device_snapshot_fallback or "")
    assert failed.device_snapshot_bytes > 0 and failed.device_direct_bytes > 0  # two clones, the rest direct
    native_state.steps(model, opt, 1, seed=3)  # training goes on
    after = _saved_exactly(manager, str(tmp_path), "s2", model, opt)
    assert after.device_snapshot_fallback is None
    assert after.device_budget_bytes == failed.device_snapshot_bytes // 2  # the kept budget shrank
    manager.finalize()


@fake_only
@run_with_ranks(2)
def test_ranks_agree_on_the_least_budget_in_the_saves_first_step_and_keep_it(tmp_path):
    import torch.distributed as dist

    from harness import native_state
    from nxd_ckpt.manager import CheckpointManager

    device, rank = _fake(), dist.get_rank()
    model_bytes = native_state.state_bytes(device, WIDTH)
    proposals = [_set_memory(256 * MiB, 256 * MiB - (2 + r) * model_bytes) for r in (1, 0)]  # rank 0's last
    if rank == 1:
        _set_memory(256 * MiB, 256 * MiB - 3 * model_bytes)  # this rank has more room: it proposes more
    manager = CheckpointManager()
    host_model = torch.nn.Linear(4, 4)
    steps_before = manager.coordinator()._step
    manager.save(str(tmp_path), "host", model=host_model, async_save=True).wait()
    host_steps, steps_before = manager.coordinator()._step - steps_before, manager.coordinator()._step
    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1)
    report = manager.save(str(tmp_path), "s1", model=model, optimizer=opt, async_save=True, use_xser=True).wait()
    assert manager.coordinator()._step - steps_before == host_steps, "the agreement took a round of its own"
    assert report.device_budget_bytes == min(proposals) == proposals[1] < proposals[0]
    assert 0 < report.device_snapshot_bytes <= report.device_budget_bytes
    _set_memory(256 * MiB, 0)  # both ranks would now propose more: the agreed budget is kept
    again = manager.save(str(tmp_path), "s2", model=model, optimizer=opt, async_save=True, use_xser=True).wait()
    assert again.device_budget_bytes == report.device_budget_bytes
    assert again.device_snapshot_bytes == report.device_snapshot_bytes
    manager.finalize()
