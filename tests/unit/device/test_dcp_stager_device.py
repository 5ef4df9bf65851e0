"""nxd_ckpt.dcp.Stager with device state on the fake accelerator (``harness.fake_accelerator``, installed in a
spawned process): ``dcp.async_save`` returns after the device snapshot, a training step right after it changes
nothing saved, stock ``dcp.load`` reads each of three saves through one stager bit-exactly (with the snapshot and
with a zero snapshot budget, where the call copies into pinned buffers itself), a failed transfer reaches the
caller through the futures, the ranks agree on one snapshot budget in DCP's own plan gather (no collective of its
own) and keep it, and an out-of-memory in the snapshot is reported and shrinks the budget."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.backend_registration as backend_registration

from harness.multiprocess import run_on_ranks

pytestmark = [
    pytest.mark.device_independent,  # the fake accelerator: runs once, in the CPU lane
    pytest.mark.skipif(
        not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
        reason=f"torch {torch.__version__} cannot register a backend written in Python (torch >= 2.10 can)",
    ),
]

WIDTH = 128


def _training(device: str):
    from harness import native_state

    model, opt = native_state.training(device, WIDTH)
    native_state.steps(model, opt, 1, seed=1, autograd=False)  # optimizer moments exist
    return model, opt


def _state(model, opt) -> dict:
    """Model and optimizer tensors on the device, by name, and a train state."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {f"{names[id(p)]}.{k}": v for p, s in opt.state.items() for k, v in s.items() if v.dim() > 0}
    return {"model": model.state_dict(), "optim": optim, "train_state": {"step": 1}}


def _on_host(state: dict) -> dict:
    return {
        key: {k: v.detach().to("cpu").clone() for k, v in part.items()} if key != "train_state" else dict(part)
        for key, part in state.items()
    }


def _saves_survive_training(path: str, budget) -> None:
    import torch.distributed.checkpoint as dcp

    from harness import fake_accelerator, native_state
    from nxd_ckpt.dcp import Stager, StorageWriter

    warnings.simplefilter("ignore")
    fake_accelerator.install()
    device = f"{fake_accelerator.DEVICE_TYPE}:0"
    model, opt = _training(device)
    stager = Stager(device_snapshot_budget=budget)
    for n in range(3):
        state = _state(model, opt)
        want = _on_host(state)
        response = dcp.async_save(state, storage_writer=StorageWriter(f"{path}/step-{n}"), async_stager=stager)
        native_state.steps(model, opt, 1, seed=10 + n, autograd=False)  # right after the call returns
        response.upload_completion.result(timeout=60)
        got = {key: {k: torch.zeros_like(v) for k, v in want[key].items()} for key in ("model", "optim")}
        got["train_state"] = {"step": -1}
        dcp.load(got, storage_reader=dcp.FileSystemReader(f"{path}/step-{n}"))
        for key in ("model", "optim"):
            for k, v in want[key].items():
                assert torch.equal(got[key][k], v), (n, key, k)
        assert got["train_state"] == {"step": 1}
        assert torch.equal(want["model"]["0.weight"], got["model"]["0.weight"])
        assert not torch.equal(model.state_dict()["0.weight"].to("cpu"), want["model"]["0.weight"])
    stager.close()


@pytest.mark.parametrize("budget", [None, 0], ids=["snapshot", "direct"])
def test_device_saves_through_one_stager_survive_the_next_step(tmp_path, budget):
    run_on_ranks(_saves_survive_training, 1, {"path": str(tmp_path), "budget": budget})


def _failed_transfer_reaches_the_caller(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from harness import fake_accelerator, native_state
    from nxd_ckpt.dcp import Stager, StorageWriter
    from nxd_ckpt.device.transfer import DeviceTransfer

    warnings.simplefilter("ignore")
    fake_accelerator.install()
    model, opt = _training(f"{fake_accelerator.DEVICE_TYPE}:0")
    stager = Stager()
    with native_state.patched() as monkeypatch:

        def broken(self, sources):
            raise RuntimeError("injected: the device copy failed")

        monkeypatch.setattr(DeviceTransfer, "_copy_chunk", broken)
        response = dcp.async_save(
            _state(model, opt), storage_writer=StorageWriter(f"{path}/step-0"), async_stager=stager
        )
        with pytest.raises(Exception, match="injected: the device copy failed"):
            response.upload_completion.result(timeout=60)
        # (staging_completion: DCP reports a staging future that failed before async_save looked as completed)
    response = dcp.async_save(_state(model, opt), storage_writer=StorageWriter(f"{path}/step-1"), async_stager=stager)
    response.upload_completion.result(timeout=60)  # the failed save's copies went back; the stager goes on
    stager.close()


def test_a_failed_device_transfer_reaches_the_futures(tmp_path):
    run_on_ranks(_failed_transfer_reaches_the_caller, 1, {"path": str(tmp_path)})


MiB = 1 << 20
COLLECTIVES = (
    "all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "reduce_scatter", "scatter", "scatter_object_list", "all_to_all",
)  # fmt: skip


def _set_memory(free: int, peak_over_reserved: int) -> int:
    """The fake device's figures; returns what ``auto`` takes from them (as tests/unit/device/test_snapshot_budget)."""
    from harness import fake_accelerator
    from nxd_ckpt.device import backend

    fake_accelerator.FREE_BYTES, fake_accelerator.RESERVED_BYTES = free, 64 * MiB
    fake_accelerator.PEAK_RESERVED_BYTES = 64 * MiB + peak_over_reserved
    return int((free - peak_over_reserved) * backend.FREE_FRACTION)


def _counting_collectives(monkeypatch) -> dict[str, int]:
    """Counts every torch.distributed collective this process calls from now on (DCP's included)."""
    import torch.distributed as dist

    calls: dict[str, int] = {}
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    return calls


def _ranks_agree_in_the_plan_gather(path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from harness import fake_accelerator, native_state
    from nxd_ckpt.dcp import Stager, StorageWriter

    warnings.simplefilter("ignore")
    fake_accelerator.install()
    rank, device = dist.get_rank(), f"{fake_accelerator.DEVICE_TYPE}:0"
    model, opt = _training(device)
    model_bytes = native_state.state_bytes(device, WIDTH)
    own = _set_memory(256 * MiB, 256 * MiB - (1 + rank) * model_bytes)  # rank 1 has more room: it proposes more
    proposals = [None, None]
    dist.all_gather_object(proposals, own)
    stager = Stager()
    with native_state.patched() as monkeypatch:
        calls = _counting_collectives(monkeypatch)
        dcp.save(_state(model, opt), storage_writer=StorageWriter(f"{path}/sync"))
        sync_calls, _ = dict(calls), calls.clear()
        reports = []
        for n in range(3):
            state = _state(model, opt)
            want = _on_host(state)
            response = dcp.async_save(state, storage_writer=StorageWriter(f"{path}/step-{n}"), async_stager=stager)
            reports.append(stager.last_report)
            native_state.steps(model, opt, 1, seed=10 + n, autograd=False)
            response.upload_completion.result(timeout=60)
            assert calls == sync_calls, f"save {n} took collectives of its own: {calls} against {sync_calls}"
            calls.clear()
            _set_memory(256 * MiB, 0)  # both ranks would now propose all of it: the agreed budget is kept
        _assert_stock_dcp_reads(f"{path}/step-2", want)
    snapshots = [None, None]
    dist.all_gather_object(snapshots, [r.device_snapshot_bytes for r in reports[1:]])  # before a rank may fail
    assert reports[0].device_budget_bytes == own  # DCP stages before its first collective: the rank's own
    for later in reports[1:]:
        assert later.device_budget_bytes == min(proposals), (rank, proposals, reports)
    assert snapshots[0] == snapshots[1] and 0 < snapshots[0][0] < 3 * model_bytes  # one cut on every rank
    stager.close()


def test_ranks_agree_on_the_least_budget_in_dcps_plan_gather_and_keep_it(tmp_path):
    run_on_ranks(_ranks_agree_in_the_plan_gather, 2, {"path": str(tmp_path)})


def _assert_stock_dcp_reads(folder: str, want: dict) -> None:
    """Stock ``dcp.load`` (``FileSystemReader``) reads ``folder``'s model and optimizer as ``want`` holds them."""
    import torch.distributed.checkpoint as dcp

    got = {key: {k: torch.zeros_like(v) for k, v in want[key].items()} for key in ("model", "optim")}
    got["train_state"] = {"step": -1}
    dcp.load(got, storage_reader=dcp.FileSystemReader(folder))
    for key in ("model", "optim"):
        for k, v in want[key].items():
            assert torch.equal(got[key][k], v), (key, k)


def _out_of_memory_shrinks_the_budget(path: str) -> None:
    import logging

    import torch.distributed.checkpoint as dcp

    from harness import fake_accelerator, native_state
    from nxd_ckpt.dcp import Stager, StorageWriter

    warnings.simplefilter("ignore")
    fake_accelerator.install()
    model, opt = _training(f"{fake_accelerator.DEVICE_TYPE}:0")
    _set_memory(256 * MiB, 0)  # the budget holds the whole state
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nxd_ckpt").addHandler(handler)
    stager = Stager()
    state = _state(model, opt)
    want = _on_host(state)
    with fake_accelerator.out_of_memory_after(clones=2):  # the device is fuller than its figures said
        response = dcp.async_save(state, storage_writer=StorageWriter(f"{path}/step-0"), async_stager=stager)
    failed = stager.last_report
    native_state.steps(model, opt, 1, seed=3, autograd=False)  # training goes on
    response.upload_completion.result(timeout=60)
    _assert_stock_dcp_reads(f"{path}/step-0", want)
    assert "ran out of memory" in (failed.device_snapshot_fallback or ""), failed
    assert failed.device_snapshot_bytes > 0 and failed.device_direct_bytes > 0  # two clones, the rest direct
    assert any("ran out of memory" in m for m in warned), warned
    response = dcp.async_save(_state(model, opt), storage_writer=StorageWriter(f"{path}/step-1"), async_stager=stager)
    after = stager.last_report
    response.upload_completion.result(timeout=60)
    assert after.device_snapshot_fallback is None
    assert after.device_budget_bytes == failed.device_snapshot_bytes // 2, (failed, after)  # the kept one shrank
    stager.close()


def test_an_out_of_memory_in_the_snapshot_is_reported_and_the_next_save_fits(tmp_path):
    run_on_ranks(_out_of_memory_shrinks_the_budget, 1, {"path": str(tmp_path)})
