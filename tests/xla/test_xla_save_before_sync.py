"""A save called after ``optimizer.step()`` but before the step's ``torch_xla.sync()``: the state's values are still a
pending graph. The save runs that graph once, as the user's own sync would (``xla.run_pending_step``), so the tag
holds the stepped state, the user's sync has nothing left to run, no new graph is compiled for it, and the device
RNG seed advances at the user's sync exactly as without the save. The same holds for ``nxd_ckpt.dcp.Stager`` (the
DCP front end), and in both front ends the run resets the all-reduce token as ``torch_xla.sync()`` does: a
collective traced between the save and the user's sync does not carry the executed step into the next graph.
"""

from __future__ import annotations

import pytest
import torch

import nxd_ckpt as nxd
from harness.held_transfer import host_copy
from harness.xla_metrics import xla_graph_compiles, xla_graph_executions
from nxd_ckpt import xla
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"
torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)
xm = pytest.importorskip("torch_xla.core.xla_model", reason=XLA_LANE_ONLY)


def _training(width: int, kind: str = "plain") -> tuple[torch.nn.Module, object]:
    """A model + optimizer of shapes no other test uses (XLA's graph cache is the process's), with dropout (the step
    draws from the device RNG), trained two steps with a sync after each."""
    torch.manual_seed(width)
    device = torch_xla.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.Dropout(0.1), torch.nn.Linear(2 * width, width)
    ).to(device)
    if kind == "zero1":
        zero = pytest.importorskip("torch_xla.distributed.zero_redundancy_optimizer", reason=XLA_LANE_ONLY)
        opt = zero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, opt, width, i)
        torch_xla.sync()
    xm.wait_device_ops()
    return model, opt


def _step(model: torch.nn.Module, opt, width: int, seed: int, *, scatter: bool = False) -> None:
    """One optimizer step, not synced: the parameters' new values are a pending graph. With ``scatter`` the
    gradients go through a reduce-scatter (a collective ordered by the device's all-reduce token, as ZeRO-1's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, width, generator=g).to(torch_xla.device())
    loss = torch.nn.functional.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    if scatter:
        for p in model.parameters():
            p.grad = xm.reduce_scatter(xm.REDUCE_SUM, p.grad, 1.0, 0, 1)
    opt.step()


def _sync_executions() -> int:
    """Graphs the user's sync ran (waited for)."""
    xm.wait_device_ops()
    before = xla_graph_executions()
    torch_xla.sync()
    xm.wait_device_ops()
    return xla_graph_executions() - before


@pytest.mark.parametrize(("kind", "use_xser"), [("plain", False), ("plain", True), ("zero1", True)])
@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_before_the_sync_runs_the_step_once_and_the_tag_holds_the_stepped_state(
    tmp_path, kind, use_xser, async_save
):
    width = {("plain", False): 152, ("plain", True): 154, ("zero1", True): 156}[(kind, use_xser)] + int(async_save)
    model, opt = _training(width, kind)
    _step(model, opt, width, seed=7)
    assert xla.pending(list(model.parameters()))
    report = nxd.save_checkpoint(
        str(tmp_path), "pending", model=model, optimizer=opt, async_save=async_save, use_xser=use_xser
    )
    assert report.ran_pending_step
    assert not xla.pending(list(model.parameters())), "the save left the step's graph pending"
    assert _sync_executions() == 0, "the user's sync ran the step again"
    report.wait()
    nxd.finalize_checkpoint()
    expected_model, expected_opt = host_copy(model.state_dict()), host_copy(opt.state_dict())

    model2, opt2 = _training(width, kind)
    nxd.load_checkpoint(str(tmp_path), "pending", model=model2, optimizer=opt2)
    assert_state_equal(host_copy(model2.state_dict()), expected_model)  # the stepped state, not the step before
    loaded = host_copy(opt2.state_dict())
    key = "base_state" if kind == "zero1" else "state"
    assert_state_equal(loaded[key], expected_opt[key])


def test_saves_before_the_sync_compile_nothing_after_the_first(tmp_path):
    width = 161
    model, opt = _training(width)
    compiles = []
    for i in range(4):
        _step(model, opt, width, seed=10 + i)
        before = xla_graph_compiles()
        report = nxd.save_checkpoint(str(tmp_path), f"s{i}", model=model, optimizer=opt, async_save=True)
        torch_xla.sync()
        compiles.append(xla_graph_compiles() - before)
        assert report.ran_pending_step and report.device_snapshot_bytes > 0
        report.wait()
    nxd.finalize_checkpoint()
    # the first save compiles its snapshot graph only: the step's graph is the one the user's syncs compiled
    assert compiles == [1, 0, 0, 0]


def test_the_device_rng_advances_at_the_users_sync_as_without_the_save(tmp_path):
    width = 163
    seeds = []
    for save in (False, True):
        xm.set_rng_state(1234)
        model, opt = _training(width)
        _step(model, opt, width, seed=3)
        if save:
            nxd.save_checkpoint(str(tmp_path), "rng", model=model, optimizer=opt, async_save=True).wait()
        torch_xla.sync()
        _step(model, opt, width, seed=4)  # dropout draws from the seed the sync left
        torch_xla.sync()
        seeds.append((xm.get_rng_state(), host_copy(model.state_dict())))
    nxd.finalize_checkpoint()
    assert seeds[0][0] == seeds[1][0]
    assert_state_equal(seeds[0][1], seeds[1][1])


def test_a_save_of_synced_state_runs_no_step(tmp_path):
    model, opt = _training(165)
    before = xla_graph_executions()
    report = nxd.save_checkpoint(str(tmp_path), "synced", model=model, optimizer=opt, async_save=True)
    report.wait()
    nxd.finalize_checkpoint()
    assert not report.ran_pending_step
    assert xla_graph_executions() - before == 1  # the snapshot's clones only


def _dcp_save(path: str, model: torch.nn.Module, opt, stager) -> object:
    """An async DCP save of the model and optimizer through ``nxd_ckpt.dcp``'s writer and ``stager``."""
    import torch.distributed.checkpoint as dcp

    from nxd_ckpt.dcp import StorageWriter

    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    return dcp.async_save(state, storage_writer=StorageWriter(path), async_stager=stager)


def test_a_dcp_stager_save_before_the_sync_runs_the_step_once_and_saves_the_stepped_state(tmp_path):
    import torch.distributed.checkpoint as dcp

    from nxd_ckpt.dcp import Stager

    width = 167
    model, opt = _training(width)
    _step(model, opt, width, seed=7)
    assert xla.pending(list(model.parameters()))
    stager = Stager()
    response = _dcp_save(str(tmp_path / "step-1"), model, opt, stager)
    assert not xla.pending(list(model.parameters())), "the stager left the step's graph pending"
    assert _sync_executions() == 0, "the user's sync ran the step again"
    assert stager.last_report.ran_pending_step
    response.upload_completion.result(timeout=120)
    expected = host_copy(model.state_dict())
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "step-1")))
    assert_state_equal(loaded["model"], expected)  # the stepped state, not the step before
    _step(model, opt, width, seed=8)
    torch_xla.sync()  # a save of synced state: nothing pending, no step run
    _dcp_save(str(tmp_path / "step-2"), model, opt, stager).upload_completion.result(timeout=120)
    assert not stager.last_report.ran_pending_step
    stager.close()


@pytest.mark.parametrize("front_end", ["save_checkpoint", "dcp_stager"])
def test_a_collective_between_the_save_and_the_sync_does_not_trace_the_executed_step(tmp_path, front_end):
    from nxd_ckpt.dcp import Stager

    width = 169 + (front_end == "dcp_stager")
    model, opt = _training(width)
    _step(model, opt, width, seed=1, scatter=True)
    torch_xla.sync()
    _step(model, opt, width, seed=2, scatter=True)  # the token is now an IR value of this step's graph
    if front_end == "save_checkpoint":
        report = nxd.save_checkpoint(str(tmp_path), "pending", model=model, optimizer=opt, async_save=True)
        assert report.ran_pending_step
    else:
        stager = Stager()
        response = _dcp_save(str(tmp_path / "step-2"), model, opt, stager)
    gathered = xm.reduce_scatter(xm.REDUCE_SUM, torch.ones(4, device=torch_xla.device()), 1.0, 0, 1)
    graph = torch_xla._XLAC._get_xla_tensors_text([gathered])
    assert "addmm" not in graph and "aten::mm" not in graph, f"the collective traced the executed step:\n{graph}"
    torch_xla.sync()  # with the step in its graph: run again, on buffers the step donated (torch_xla raises)
    assert torch.equal(gathered.cpu(), torch.ones(4))
    assert front_end == "save_checkpoint" or stager.last_report.ran_pending_step
    if front_end == "save_checkpoint":
        report.wait()
        nxd.finalize_checkpoint()
    else:
        response.upload_completion.result(timeout=120)
        stager.close()
