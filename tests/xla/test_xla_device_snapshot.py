"""Async saves of XLA state: the call snapshots the state on the device and returns; the transfer to the host, the
writes and the commit run while training goes on (``nxd_ckpt.device.snapshot``).

The transfer thread is held back until the training thread has run several optimizer steps, so a save that did not
snapshot (that read the live tensors later) would write the state of the last step, not of the call: the
``control`` test shows that the check catches exactly that.
"""

from __future__ import annotations

import threading

import pytest
import torch

import nxd_ckpt as nxd
from harness.held_transfer import HeldTransfer, host_copy
from harness.xla_metrics import xla_graph_compiles, xla_graph_executions
from nxd_ckpt import xla
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import SnapshotBudget
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"
torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)

STEPS_IN_FLIGHT = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Tanh(), torch.nn.Linear(512, 128)).to(
        torch_xla.device()
    )


def _training(kind: str) -> tuple[torch.nn.Module, object]:
    model = _model()
    if kind == "zero1":
        zero = pytest.importorskip("torch_xla.distributed.zero_redundancy_optimizer", reason=XLA_LANE_ONLY)
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _steps(model: torch.nn.Module, opt, steps: int, seed: int) -> None:
    device = torch_xla.device()
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        x = torch.randn(32, 128, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()


def _save_train_and_check(tmp_path, monkeypatch, kind: str, background: bool = True, **save_keywords) -> nxd.SaveReport:
    model, opt = _training(kind)
    _steps(model, opt, 3, seed=1)
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    gate = HeldTransfer(monkeypatch)
    report = nxd.save_checkpoint(
        str(tmp_path), "step_3", model=model, optimizer=opt, async_save=True, use_xser=kind != "plain", **save_keywords
    )
    try:
        _steps(model, opt, STEPS_IN_FLIGHT, seed=2)  # training goes on while the save travels
        if background:  # held: the save cannot be complete before the transfer is released
            assert not report.completed, "the save finished before training went on: nothing was in flight"
    finally:
        gate.release()
    report.wait()
    nxd.finalize_checkpoint()
    if background:
        assert gate.threads and threading.get_ident() not in gate.threads, "the transfer ran on the training thread"
    else:
        assert not gate.threads
    assert host_copy(model.state_dict())["0.weight"].ne(expected_model["0.weight"]).any(), "training did not change it"

    model2, opt2 = _training(kind)
    _steps(model2, opt2, 1, seed=9)  # an optimizer with state to overwrite
    nxd.load_checkpoint(str(tmp_path), "step_3", model=model2, optimizer=opt2)
    assert_state_equal(host_copy(model2.state_dict()), expected_model)
    loaded = host_copy(opt2.state_dict())
    if kind == "zero1":
        assert_state_equal(loaded["base_state"], expected_opt["base_state"])
        assert_state_equal(loaded["sharded_master_weights"], expected_opt["sharded_master_weights"])
    else:
        assert_state_equal(loaded["state"], expected_opt["state"])
    return report


@pytest.mark.parametrize("kind", ["plain", "xser", "zero1"])
def test_training_goes_on_while_the_save_travels_and_the_tag_holds_the_call(tmp_path, monkeypatch, kind):
    report = _save_train_and_check(tmp_path, monkeypatch, kind)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0
    assert report.device_budget_bytes >= report.device_snapshot_bytes


def test_control_without_the_snapshot_the_check_fails(tmp_path, monkeypatch):
    """The same save, but transferring the live tensors instead of their device copies: the tag then holds the
    state after the steps run meanwhile, and the check above fails. So it cannot pass without the snapshot."""

    def no_snapshot(tensors, keys, fit, rest, chunk_bytes, links):
        live = [tensors[i] for i in fit]  # references, no copy: what holding the state would do
        transfer = DeviceTransfer([keys[i] for i in fit], live, chunk_bytes=chunk_bytes, background=True, **links)
        return transfer, fit, rest, None

    monkeypatch.setattr(device_snapshot, "_take_xla", no_snapshot)
    with pytest.raises(AssertionError):
        _save_train_and_check(tmp_path, monkeypatch, "xser")


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_tied_weights_are_cloned_and_moved_once_and_written_as_a_sync_save_writes_them(tmp_path, monkeypatch, use_xser):
    """torch_xla gives the two detached entries of a tied weight one tensor id (``xla.tensor_id``)."""
    from harness import tied_weights

    report = tied_weights.saved_once_and_loaded_tied(str(tmp_path), torch_xla.device(), monkeypatch, use_xser)
    assert report.device_direct_bytes == 0


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_a_budget_smaller_than_the_state_still_saves_the_call_exactly(tmp_path, monkeypatch, use_xser):
    """A third of the state fits on the device: the call moves the rest to the host itself (reported), the snapshot
    never exceeds the budget, and the tag holds the state of the call."""
    model, opt = _training("plain")
    _steps(model, opt, 1, seed=1)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.device.type == "xla"
    )
    budget = state_bytes // 3
    peak = _PeakDeviceBytes(monkeypatch)
    kind = "xser" if use_xser else "plain"
    report = _save_train_and_check(tmp_path / "b", monkeypatch, kind, device_snapshot_budget=budget)
    assert 0 < report.device_snapshot_bytes <= budget
    assert report.device_direct_bytes > 0 and report.device_direct_s > 0
    assert report.device_budget_bytes == budget
    assert 0 < peak.bytes <= budget


@pytest.mark.parametrize("kind", ["plain", "xser", "zero1"])
def test_under_a_host_memory_budget_the_call_snapshots_and_the_state_travels_within_the_budget(
    tmp_path, monkeypatch, kind
):
    """With a host memory budget of a quarter of the state, the call returns after the snapshot on the device; its
    copies come to the host beside training, never more than the budget at once (beyond what a writer that got
    ahead of them copied itself), and the tag holds the state of the call."""
    stagers = _Stagers(monkeypatch)
    model, opt = _training(kind)
    _steps(model, opt, 1, seed=1)
    budget = sum(t.numel() * t.element_size() for t in xla_state_tensors(model, opt)) // 4
    report = _save_train_and_check(tmp_path, monkeypatch, kind, host_memory_budget=budget)
    assert report.device_snapshot_bytes > 0 and report.device_direct_bytes == 0
    (stager,) = stagers.made
    assert stager.peak_bytes <= budget + stager.overdrawn_bytes
    assert (report.budget_peak_bytes, report.budget_overdrawn_bytes) == (stager.peak_bytes, stager.overdrawn_bytes)
    assert stager.staged_bytes >= report.device_snapshot_bytes
    assert not stager._frozen, "a device copy outlived the save"


def xla_state_tensors(model: torch.nn.Module, opt) -> list[torch.Tensor]:
    """The XLA tensors of the model's and the optimizer's state."""
    from nxd_ckpt.tree import iter_tensors

    found = [t for _, t in iter_tensors([model.state_dict(), opt.state_dict()]) if t.device.type == "xla"]
    return list({id(t): t for t in found}.values())


class _Stagers:
    """Every ``BudgetedStager`` made while the test runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from nxd_ckpt.save.budget import BudgetedStager

        self.made: list[BudgetedStager] = []
        real_init = BudgetedStager.__init__

        def init(stager, *args, **kwargs):
            real_init(stager, *args, **kwargs)
            self.made.append(stager)

        monkeypatch.setattr(BudgetedStager, "__init__", init)


def test_a_zero_budget_takes_no_snapshot_and_saves_on_the_call(tmp_path, monkeypatch):
    monkeypatch.setenv("NXD_CKPT_DEVICE_SNAPSHOT_BUDGET", "0")
    report = _save_train_and_check(tmp_path, monkeypatch, "xser", background=False)
    assert report.device_snapshot_bytes == 0 and report.device_direct_bytes > 0


class _PeakDeviceBytes:
    """The most bytes of device copies any transfer held at once (sampled at each chunk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        real_init = DeviceTransfer.__init__
        real_chunk = DeviceTransfer._copy_chunk

        def init(transfer, *args, **kwargs):
            real_init(transfer, *args, **kwargs)
            self.bytes = max(self.bytes, transfer.device_bytes_held)

        def chunk(transfer, sources):
            self.bytes = max(self.bytes, transfer.device_bytes_held)
            return real_chunk(transfer, sources)

        monkeypatch.setattr(DeviceTransfer, "__init__", init)
        monkeypatch.setattr(DeviceTransfer, "_copy_chunk", chunk)


def test_each_chunk_frees_its_device_copies_as_it_reaches_the_host(monkeypatch):
    device = torch_xla.device()
    tensors = [torch.full((256, 256), float(i)).to(device) for i in range(6)]
    torch_xla.sync()
    snap = device_snapshot.take(tensors, device_snapshot.SnapshotBudget(None), chunk_bytes=256 * 256 * 4 * 2)
    transfer = snap.transfer
    held: list[int] = []
    for i, t in enumerate(tensors):
        host = transfer.host(snap.stand_ins[id(t)])
        assert torch.equal(host, torch.full((256, 256), float(i)))
        held.append(transfer.device_bytes_held)
    transfer.close()
    assert held[-1] == 0 and held == sorted(held, reverse=True) and held[0] < snap.snapshot_bytes
    assert all(s is None for s in transfer._sources) and snap.snapshot_bytes == 6 * 256 * 256 * 4


def test_a_failed_transfer_fails_the_save_on_the_next_call(tmp_path, monkeypatch):
    model, opt = _training("plain")
    _steps(model, opt, 1, seed=1)

    def broken(chunk):
        raise RuntimeError("device lost")

    monkeypatch.setattr(xla, "fetch", broken)
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, optimizer=opt, async_save=True)
    with pytest.raises(nxd.AsyncSaveError) as raised:
        nxd.finalize_checkpoint()
    assert "device lost" in str(raised.value.__cause__)
    assert not (tmp_path / "step_1" / "done").exists()
    assert nxd.latest_checkpoint_tag(str(tmp_path)) is None


def _odd_training(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model + AdamW of shapes no other test uses (XLA's graph cache is the process's), trained one step."""
    torch.manual_seed(width)
    device = torch_xla.device()
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps_odd(model, opt, width)
    return model, opt


def _steps_odd(model: torch.nn.Module, opt, width: int) -> None:
    """One optimizer step of an ``_odd_training`` state, synced."""
    model(torch.ones(4, width, device=torch_xla.device())).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()


def _save_compiles(tmp_path, tag: str, model, opt, **keywords) -> int:
    before = xla_graph_compiles()
    report = nxd.save_checkpoint(str(tmp_path), tag=tag, model=model, optimizer=opt, async_save=True, **keywords)
    compiled = xla_graph_compiles() - before
    report.wait()
    assert report.device_snapshot_bytes > 0
    return compiled


def test_prepare_async_save_compiles_the_snapshot_graph_so_the_first_save_compiles_nothing(tmp_path):
    model, opt = _odd_training(37)
    before = xla_graph_compiles()
    nxd.prepare_async_save(model=model, optimizer=opt)
    assert xla_graph_compiles() - before == 1  # the snapshot graph, compiled (and run once)
    assert _save_compiles(tmp_path, "xser", model, opt, use_xser=True) == 0
    assert _save_compiles(tmp_path, "plain", model, opt, use_xser=False) == 0
    nxd.finalize_checkpoint()
    loaded_model, loaded_opt = _odd_training(37)
    nxd.load_checkpoint(str(tmp_path), tag="xser", model=loaded_model, optimizer=loaded_opt)
    assert_state_equal(loaded_model.state_dict(), model.state_dict())


def test_control_without_prepare_async_save_the_first_save_compiles_its_snapshot(tmp_path):
    model, opt = _odd_training(41)
    assert _save_compiles(tmp_path, "first", model, opt, use_xser=True) == 1
    assert _save_compiles(tmp_path, "second", model, opt, use_xser=True) == 0
    nxd.finalize_checkpoint()


def test_the_snapshot_graph_depends_on_the_shapes_not_on_the_order_a_save_lists_its_tensors(tmp_path):
    model, opt = _odd_training(43)
    tensors = [*model.state_dict().values()] + [v for s in opt.state.values() for v in s.values() if xla.is_xla(v)]
    before = xla_graph_compiles()
    device_snapshot.warm(list(reversed(tensors)), SnapshotBudget(None))
    assert xla_graph_compiles() - before == 1
    assert _save_compiles(tmp_path, "after_warm", model, opt, use_xser=True) == 0
    nxd.finalize_checkpoint()


def test_a_state_with_pending_graphs_is_not_warmed_the_step_is_not_compiled_into_a_snapshot(tmp_path):
    model, opt = _odd_training(47)
    model(torch.ones(4, 47, device=torch_xla.device())).sum().backward()
    opt.step()  # no sync yet: the parameters' values are a pending graph
    tensors = [*model.state_dict().values()]
    before = xla_graph_compiles()
    assert device_snapshot.warm(tensors, SnapshotBudget(None)) == 0
    assert xla_graph_compiles() == before and xla.pending(tensors)
    torch_xla.sync()
    assert not xla.pending(tensors) and device_snapshot.warm(tensors, SnapshotBudget(None)) > 0


def test_ahead_of_the_save_a_rank_snapshots_what_its_save_will_by_the_saves_plan(tmp_path):
    from nxd_ckpt.manager import CheckpointManager
    from nxd_ckpt.ranks.topology import Topology

    model, opt = _odd_training(136)  # weights over the 64 KiB xser inline limit: tensor files, shared by replicas
    replica = CheckpointManager(topology=Topology(dp_size=2, rank=1))
    before = xla_graph_compiles()
    replica.prepare_async_save(model=model, optimizer=opt)  # plain: the other replica writes the files
    assert xla_graph_compiles() == before
    replica.prepare_async_save(model=model, optimizer=opt, use_xser=True)  # xser: this replica's share
    assert xla_graph_compiles() == before + 1
    CheckpointManager(topology=Topology(dp_size=1, rank=0)).prepare_async_save(model=model, optimizer=opt)
    assert xla_graph_compiles() == before + 2  # the whole state


def _tag_saved(tmp_path, width: int, *, async_save: bool) -> str:
    """A tag of ``_odd_training(width)``, saved without compiling its snapshot graph here (an async save with a
    snapshot budget of 0 moves the state in its call), so that a load in this process stands for a fresh one's."""
    model, opt = _odd_training(width)
    before = xla_graph_compiles()
    keywords = {"async_save": True, "device_snapshot_budget": 0} if async_save else {}
    nxd.save_checkpoint(str(tmp_path), "saved", model=model, optimizer=opt, use_xser=True, **keywords)
    nxd.finalize_checkpoint()
    assert xla_graph_compiles() == before
    return "saved"


def _load_compiles(tmp_path, model, opt, **keywords) -> int:
    before = xla_graph_compiles()
    nxd.load_checkpoint(str(tmp_path), model=model, optimizer=opt, **keywords)
    return xla_graph_compiles() - before


def test_a_resume_of_an_async_saved_tag_compiles_the_snapshot_graph_so_the_first_save_compiles_nothing(tmp_path):
    _tag_saved(tmp_path, 59, async_save=True)
    model, opt = _odd_training(59)
    assert _load_compiles(tmp_path, model, opt) == 1  # the snapshot graph, moved into the load
    _steps_odd(model, opt, 59)
    assert _save_compiles(tmp_path, "after_resume", model, opt, use_xser=True) == 0
    nxd.finalize_checkpoint()


def test_control_a_resume_of_a_synchronously_saved_tag_prepares_nothing(tmp_path):
    _tag_saved(tmp_path, 61, async_save=False)
    model, opt = _odd_training(61)
    assert _load_compiles(tmp_path, model, opt) == 0
    assert _save_compiles(tmp_path, "after_resume", model, opt, use_xser=True) == 1
    nxd.finalize_checkpoint()


def test_control_prepare_on_resume_off_leaves_the_compile_to_the_first_save(tmp_path, monkeypatch):
    _tag_saved(tmp_path, 67, async_save=True)
    monkeypatch.setenv("NXD_CKPT_PREPARE_ON_RESUME", "0")
    model, opt = _odd_training(67)
    assert _load_compiles(tmp_path, model, opt) == 0
    assert _save_compiles(tmp_path, "after_resume", model, opt, use_xser=True) == 1
    nxd.finalize_checkpoint()


def test_a_snapshot_graph_already_run_is_not_run_again_by_a_later_preparation(tmp_path):
    _tag_saved(tmp_path, 73, async_save=True)
    model, opt = _odd_training(73)
    _load_compiles(tmp_path, model, opt)
    before = xla_graph_executions()
    nxd.prepare_async_save(model=model, optimizer=opt, use_xser=True)  # as Lightning's strategies do after a step
    assert xla_graph_executions() == before  # the resume ran this graph: no second clone of the state
    nxd.prepare_async_save(model=model)  # the model alone: another graph, run once
    assert xla_graph_executions() == before + 1
    nxd.finalize_checkpoint()


def test_a_resume_of_the_model_alone_does_not_prepare_a_save_of_model_and_optimizer(tmp_path):
    _tag_saved(tmp_path, 71, async_save=True)
    model, _ = _odd_training(71)
    before = xla_graph_compiles()
    nxd.load_checkpoint(str(tmp_path), model=model)
    assert xla_graph_compiles() == before  # a graph of the model alone would not be the save's
