"""nxd_ckpt.dcp.Stager with device state on the fake accelerator (``harness.fake_accelerator``, installed in a
spawned process): ``dcp.async_save`` returns after the device snapshot, a training step right after it changes
nothing saved, stock ``dcp.load`` reads each of three saves through one stager bit-exactly (with the snapshot and
with a zero snapshot budget, where the call copies into pinned buffers itself), and a failed transfer reaches the
caller through the futures."""

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
