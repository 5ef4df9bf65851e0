"""Device->host staging of real XLA tensors: one graph execution for everything, batched bulk transfers."""

from __future__ import annotations

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import xla
from nxd_ckpt.device import transfer
from nxd_ckpt.testing.fakes import make_training, train_steps
from nxd_ckpt.tree import iter_tensors

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)
metrics = pytest.importorskip("torch_xla.debug.metrics", reason=XLA_LANE_ONLY)


def _executions() -> int:
    return int(metrics.counter_value("ExecuteComputation") or 0)


def _transfers() -> int:
    data = metrics.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def test_pending_graphs_run_once_and_batches_follow_the_budget():
    device = torch_xla.device()
    a = torch.arange(64, dtype=torch.float32).reshape(8, 8).to(device)
    b = torch.ones(16, dtype=torch.bfloat16).to(device)
    torch_xla.sync()
    pending = [a @ a, b * 3, a.sum(), (a + 1).to(torch.int32)]  # four lazy results, none computed yet
    expected = [a.cpu() @ a.cpu(), b.cpu() * 3, a.cpu().sum(), (a.cpu() + 1).to(torch.int32)]
    runs, fetches = _executions(), _transfers()
    host = xla.to_cpu(pending, batch_bytes=256)  # 256 B + 32 B + 4 B + 256 B -> 3 batches
    assert _executions() - runs == 1, "all pending graphs must be materialised by one execution"
    assert _transfers() - fetches == len(xla.plan_batches([256, 32, 4, 256], 256)) == 3
    for got, want in zip(host, expected, strict=True):
        assert got.device.type == "cpu" and got.dtype == want.dtype
        assert torch.equal(got, want)


def test_a_background_transfer_starts_with_a_small_chunk_and_doubles_it(monkeypatch):
    """The writers get the first tensors soon: the first chunk is small, the next ones grow to the chunk size."""
    device = torch_xla.device()
    cpu = [torch.full((1024,), float(i)) for i in range(12)]  # 4 KiB each
    on_device = [t.to(device) for t in cpu]
    torch_xla.sync()
    chunks: list[int] = []
    real_fetch = xla.fetch

    def recording_fetch(sources):
        chunks.append(sum(s.numel() * s.element_size() for s in sources))
        return real_fetch(sources)

    monkeypatch.setattr(xla, "fetch", recording_fetch)
    monkeypatch.setattr(transfer, "FIRST_CHUNK_BYTES", 4 << 10)
    copies = transfer.DeviceTransfer(on_device, on_device, chunk_bytes=16 << 10, background=True)
    host = [copies.host(t) for t in on_device]
    copies.close()
    assert chunks == [4 << 10, 8 << 10, 16 << 10, 16 << 10, 4 << 10]  # 48 KiB in all
    assert all(torch.equal(h, c) for h, c in zip(host, cpu, strict=True))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_materialises_model_and_optimizer_with_one_execution(tmp_path, async_save):
    model, opt, sched = make_training(device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=1)
    with torch.no_grad():  # pending graphs on model and optimizer tensors, as right after opt.step()
        for p in model.parameters():
            p.mul_(0.5)
        for per_param in opt.state.values():
            per_param["exp_avg"].add_(1.0)
    runs = _executions()
    report = nxd.save_checkpoint(str(tmp_path), "t", model=model, optimizer=opt, async_save=async_save)
    report.wait()
    # the pending graph runs once (``ran_pending_step``), as the user's sync would; an async save then runs its
    # snapshot's clones: model and optimizer files never cost a sync each
    assert report.ran_pending_step
    assert _executions() - runs == 1 + async_save, "model and optimizer files must share one sync"
    saved = torch.load(tmp_path / "t" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert torch.equal(saved["fc1.weight"], model.fc1.weight.cpu())


def test_staged_snapshot_is_host_memory_that_training_cannot_change():
    model, opt, sched = make_training(device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=1)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "tied": [model.fc1.weight, model.fc1.weight]}
    assert model.fc1.weight.device.type == "xla"
    assert state["optim"]["state"][0]["exp_avg"].device.type == "xla"
    host = transfer.to_host(state, copy=True)
    devices = {t.device.type for _, t in iter_tensors(host)}
    assert devices == {"cpu"}
    assert host["tied"][0] is host["tied"][1], "one tensor saved twice stays one tensor"
    before = {k: v.clone() for k, v in host["model"].items()}
    train_steps(model, opt, sched, 2, seed=2)  # in-place updates and buffer donation on the device
    for key, value in host["model"].items():
        assert torch.equal(value, before[key]), f"{key} changed after training continued"
    assert not torch.equal(host["model"]["fc1.weight"], model.fc1.weight.cpu())


def test_host_to_device_placement_is_bulk_and_keeps_sharing():
    device = torch_xla.device()
    shared = torch.randn(4, 4)
    tree = {"w": shared, "again": shared, "ints": torch.arange(5), "meta": "kept"}
    placed = xla.place_tree(tree, device)
    assert {placed[k].device.type for k in ("w", "again", "ints")} == {"xla"}
    assert placed["w"] is placed["again"] and placed["meta"] == "kept"
    assert torch.equal(placed["w"].cpu(), shared) and torch.equal(placed["ints"].cpu(), torch.arange(5))
    assert xla.tree_device(placed) == device
