"""The device snapshot budget of XLA state as one decision (``device.kept_budget``): for a fixed model and budget no
save after the first compiles anything, however the memory figure behind ``auto`` shifts; an out-of-memory in the
snapshot moves the state by the direct transfer and the save succeeds; ``prepare_async_save`` and a resume's
warm-up snapshot within the saves' budget. The same for ``nxd_ckpt.dcp.Stager`` (DCP's ``async_save``). Shapes no
other test uses: XLA's graph cache is the process's."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.held_transfer import host_copy
from harness.xla_metrics import xla_graph_compiles, xla_graph_executions
from nxd_ckpt.device import backend
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"
torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


def _training(width: int, kind: str = "plain") -> tuple[torch.nn.Module, object]:
    """A model + AdamW (ZeRO-1's for ``kind`` "zero1") of ``width``, trained one step."""
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width))
    model = model.to(torch_xla.device())
    if kind == "zero1":
        zero = pytest.importorskip("torch_xla.distributed.zero_redundancy_optimizer", reason=XLA_LANE_ONLY)
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, width)
    return model, opt


def _step(model: torch.nn.Module, opt, width: int) -> None:
    """One optimizer step, synced."""
    model(torch.ones(4, width, device=torch_xla.device())).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()


def _xla_state_bytes(model: torch.nn.Module, opt) -> int:
    from nxd_ckpt.tree import iter_tensors

    found = {id(t): t for _, t in iter_tensors([model.state_dict(), opt.state_dict()]) if t.device.type == "xla"}
    return sum(t.numel() * t.element_size() for t in found.values())


@pytest.mark.parametrize(("kind", "width"), [("plain", 79), ("xser", 83), ("zero1", 89)])
def test_no_save_after_the_first_compiles_anything_while_the_memory_figure_behind_auto_shifts(
    tmp_path, monkeypatch, kind, width
):
    model, opt = _training(width, kind)
    state = _xla_state_bytes(model, opt)
    # auto on the XLA CPU device: half the host's available memory, here shifting from save to save between the
    # whole state and a tenth of it: each figure measured anew would cut another set of clones, another graph
    figures = itertools.cycle([2 * state * (10 - k) // 10 for k in range(10)])
    monkeypatch.setattr(backend, "_host_available_bytes", lambda: next(figures))
    monkeypatch.delenv(backend.BUDGET_ENV, raising=False)
    manager = CheckpointManager()
    compiles, budgets = [], set()
    for i in range(10):
        next(figures)  # the figure moves on between saves, whoever reads it
        before = xla_graph_compiles()
        report = manager.save(str(tmp_path), f"s{i}", model=model, optimizer=opt, async_save=True,
                              use_xser=kind != "plain")  # fmt: skip
        compiles.append(xla_graph_compiles() - before)
        report.wait()
        budgets.add(report.device_budget_bytes)
        assert report.device_snapshot_bytes > 0
        _step(model, opt, width)
    manager.finalize()
    assert compiles[1:] == [0] * 9, f"saves after the first compiled: {compiles}"
    assert len(budgets) == 1


def _device_refuses_the_first_snapshot(monkeypatch) -> list[int]:
    """The snapshot's first graph asks for more than the device holds (XLA's RESOURCE_EXHAUSTED); later ones run.
    Returns the list that records the refusal (how many tensors it was to clone)."""
    real_launch = device_snapshot._launch_xla_copies
    refused: list[int] = []

    def full_device(tensors, fit, rest, *, wait):
        if not refused:
            refused.append(len(fit))
            raise RuntimeError(
                "Bad StatusOr access: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1099511627776 bytes."
            )
        return real_launch(tensors, fit, rest, wait=wait)

    monkeypatch.setattr(device_snapshot, "_launch_xla_copies", full_device)
    return refused


def test_an_out_of_memory_in_the_snapshot_moves_the_state_directly_and_the_save_succeeds(tmp_path, monkeypatch):
    width = 97
    model, opt = _training(width)
    refused = _device_refuses_the_first_snapshot(monkeypatch)
    manager = CheckpointManager(device_snapshot_budget="1TiB")  # a budget larger than the device allows
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())
    report = manager.save(str(tmp_path), "full", model=model, optimizer=opt, async_save=True, use_xser=True)
    _step(model, opt, width)  # training goes on
    report.wait()
    assert refused and report.completed and "RESOURCE_EXHAUSTED" in (report.device_snapshot_fallback or "")
    assert report.device_snapshot_bytes == 0 and report.device_direct_bytes == _xla_state_bytes(model, opt)
    loaded, loaded_opt = _training(width)
    manager.load(str(tmp_path), "full", model=loaded, optimizer=loaded_opt)
    assert_state_equal(host_copy(loaded.state_dict()), expected_model)
    assert_state_equal(host_copy(loaded_opt.state_dict())["state"], expected_opt["state"])
    after = manager.save(str(tmp_path), "after", model=model, optimizer=opt, async_save=True, use_xser=True).wait()
    assert after.device_snapshot_fallback is None and after.device_snapshot_bytes > 0
    assert after.device_budget_bytes == (1 << 40) // 2  # nothing was cloned: the kept budget halved
    manager.finalize()


def test_prepare_async_save_snapshots_within_the_saves_budget(tmp_path):
    model, opt = _training(101)
    half = _xla_state_bytes(model, opt) // 2
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()  # executions launched earlier (other tests' async syncs) are counted before, not below
    before = xla_graph_executions()
    CheckpointManager(device_snapshot_budget=0).prepare_async_save(model=model, optimizer=opt)
    CheckpointManager().prepare_async_save(model=model, optimizer=opt, device_snapshot_budget=0)
    assert xla_graph_executions() == before, "a budget of 0 still cloned the state"
    manager = CheckpointManager(device_snapshot_budget=half)
    before = xla_graph_compiles()
    manager.prepare_async_save(model=model, optimizer=opt, use_xser=True)
    assert xla_graph_compiles() - before == 1  # the graph of the clones that fit half the state
    before = xla_graph_compiles()
    report = manager.save(str(tmp_path), "half", model=model, optimizer=opt, async_save=True, use_xser=True)
    assert xla_graph_compiles() == before, "the first save's snapshot is not the one prepared"
    report.wait()
    assert 0 < report.device_snapshot_bytes <= half < report.device_direct_bytes + report.device_snapshot_bytes
    manager.finalize()


def test_a_resume_warms_up_within_the_managers_budget(tmp_path):
    width = 103
    model, opt = _training(width)
    CheckpointManager(device_snapshot_budget=0).save(
        str(tmp_path), "saved", model=model, optimizer=opt, async_save=True, use_xser=True
    ).wait()
    for budget, graphs in ((0, 0), ("1TiB", 1)):  # no clone at the resume with 0; the whole state's graph else
        manager = CheckpointManager(device_snapshot_budget=budget)
        resumed, resumed_opt = _training(width)
        before = xla_graph_compiles()
        manager.load(str(tmp_path), "saved", model=resumed, optimizer=resumed_opt)
        assert xla_graph_compiles() - before == graphs
        _step(resumed, resumed_opt, width)
        before = xla_graph_compiles()
        report = manager.save(str(tmp_path), f"after_{budget}", model=resumed, optimizer=resumed_opt,
                              async_save=True, use_xser=True)  # fmt: skip
        assert xla_graph_compiles() == before
        report.wait()
        assert (report.device_snapshot_bytes > 0) == bool(graphs)
        manager.finalize()


def _dcp_async_save(path: str, model: torch.nn.Module, opt, stager):
    import torch.distributed.checkpoint as dcp

    from nxd_ckpt.dcp import StorageWriter

    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return dcp.async_save(state, storage_writer=StorageWriter(path), async_stager=stager)


def test_stager_saves_compile_nothing_after_the_first_while_the_memory_figure_behind_auto_shifts(tmp_path, monkeypatch):
    from nxd_ckpt.dcp import Stager

    width = 107
    model, opt = _training(width)
    state = _xla_state_bytes(model, opt)
    figures = itertools.cycle([2 * state * (10 - k) // 10 for k in range(10)])
    monkeypatch.setattr(backend, "_host_available_bytes", lambda: next(figures))
    monkeypatch.delenv(backend.BUDGET_ENV, raising=False)
    stager = Stager()
    compiles, budgets = [], set()
    for i in range(6):
        next(figures)
        before = xla_graph_compiles()
        response = _dcp_async_save(str(tmp_path / f"step-{i}"), model, opt, stager)
        compiles.append(xla_graph_compiles() - before)
        budgets.add(stager.last_report.device_budget_bytes)
        assert stager.last_report.device_snapshot_bytes > 0
        response.upload_completion.result(timeout=120)  # its plan gather brought the agreed budget back
        _step(model, opt, width)
    stager.close()
    assert compiles[1:] == [0] * 5, f"saves after the first compiled: {compiles}"
    assert len(budgets) == 1


def test_stager_out_of_memory_in_the_snapshot_is_reported_and_the_kept_budget_shrinks(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from nxd_ckpt.dcp import Stager

    width = 109
    model, opt = _training(width)
    refused = _device_refuses_the_first_snapshot(monkeypatch)
    stager = Stager(device_snapshot_budget="1TiB")  # a budget larger than the device allows
    expected = host_copy(model.state_dict())
    response = _dcp_async_save(str(tmp_path / "step-1"), model, opt, stager)
    failed = stager.last_report
    _step(model, opt, width)  # training goes on
    response.upload_completion.result(timeout=120)
    assert refused and "RESOURCE_EXHAUSTED" in (failed.device_snapshot_fallback or "")
    assert failed.device_snapshot_bytes == 0 and failed.device_direct_bytes == _xla_state_bytes(model, opt)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "step-1")))
    assert_state_equal(loaded["model"], expected)
    _dcp_async_save(str(tmp_path / "step-2"), model, opt, stager).upload_completion.result(timeout=120)
    after = stager.last_report
    assert after.device_snapshot_fallback is None and after.device_snapshot_bytes > 0
    assert after.device_budget_bytes == (1 << 40) // 2  # nothing was cloned: the kept budget halved
    stager.close()
