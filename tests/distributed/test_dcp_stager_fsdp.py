"""nxd_ckpt.dcp.Stager on 2 gloo ranks with FSDP2-sharded DTensor state on CPU: three ``dcp.async_save`` calls
through one stager, each followed at once by an in-place update of the live shards; stock ``dcp.load`` reads every
save bit-exactly into a sharded model, and the staged values were DTensors of the same sharding."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import Stager, StorageWriter

pytestmark = pytest.mark.device_independent  # CPU DTensors over gloo: runs once, in the CPU lane


def _sharded(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _three_async_saves(path: str) -> None:
    warnings.simplefilter("ignore")
    model, stager = _sharded(seed=0), Stager()
    group = dist.new_group(backend="gloo")  # the uploads' collectives apart from training's (as TorchTitan does)
    for n in range(3):
        want = _full(model)
        staged = stager.stage(model.state_dict()).result()
        assert all(type(v).__name__ == "DTensor" for v in staged.values())
        assert all(
            v.placements == p.placements and v.shape == p.shape
            for v, p in zip(staged.values(), model.parameters(), strict=True)
        )
        del staged
        state = {"model": model.state_dict(), "train_state": {"step": n}}
        response = dcp.async_save(
            state, storage_writer=StorageWriter(f"{path}/step-{n}"), async_stager=stager, process_group=group
        )
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(-2.0).add_(1.0)  # the next step, right after the call returned
        response.upload_completion.result(timeout=120)
        restored = _sharded(seed=1)
        got = {"model": restored.state_dict(), "train_state": {"step": -1}}
        dcp.load(got, storage_reader=dcp.FileSystemReader(f"{path}/step-{n}"))
        restored.load_state_dict(got["model"])
        assert got["train_state"]["step"] == n
        for name, value in _full(restored).items():
            assert torch.equal(value, want[name]), (n, name)
    assert stager.last_allocated_bytes == 0  # the third save copied into the buffers of the earlier ones
    stager.close()


def test_three_async_saves_of_sharded_state_through_one_stager(tmp_path):
    run_on_ranks(_three_async_saves, 2, {"path": str(tmp_path)})
