"""nxd_ckpt.dcp on real gloo ranks with FSDP2-sharded DTensor state on CPU (``fully_shard`` over a CPU mesh):
stock ``dcp.load`` reads what our writer wrote on 2 and 4 ranks and at another world size (DCP's resharding), our
reader reads what DCP's FileSystemWriter wrote, and a damaged rank file is named on every rank."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.device_independent  # CPU DTensors over gloo: runs once, in the CPU lane

STEP = 7


def _model(seed: int) -> torch.nn.Module:
    """The same weights for a seed at every world size (initialised whole, before sharding)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))


def _sharded(seed: int) -> torch.nn.Module:
    model = _model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _state(model: torch.nn.Module, step: int) -> dict:
    """What TorchTitan saves, in small: the model's (DTensor) state dict and a train state."""
    return {"model": model.state_dict(), "train_state": {"step": step}}


def _writer(kind: str, path: str):
    return StorageWriter(path) if kind == "nxd_ckpt" else dcp.FileSystemWriter(path)


def _reader(kind: str, path: str):
    return StorageReader(path) if kind == "nxd_ckpt" else dcp.FileSystemReader(path)


def _save(path: str, writer: str) -> None:
    model = _sharded(seed=0)
    assert all(type(v).__name__ == "DTensor" for v in model.state_dict().values())
    dcp.save(_state(model, STEP), storage_writer=_writer(writer, path))


def _load_and_check(path: str, readers: tuple[str, ...]) -> None:
    """Load into a differently initialised sharded model through each reader; bit-exact against seed 0."""
    reference = _model(seed=0).state_dict()
    for reader in readers:
        model = _sharded(seed=1)
        state = _state(model, -1)
        dcp.load(state, storage_reader=_reader(reader, path))
        model.load_state_dict(state["model"])
        assert state["train_state"]["step"] == STEP
        for name, value in model.state_dict().items():
            assert torch.equal(value.full_tensor(), reference[name]), (reader, name)


def _save_then_load(path: str, writer: str, readers: tuple[str, ...]) -> None:
    warnings.simplefilter("ignore")
    _save(path, writer)
    _load_and_check(path, readers)


def _load_only(path: str, readers: tuple[str, ...]) -> None:
    warnings.simplefilter("ignore")
    _load_and_check(path, readers)


def _save_only(path: str, writer: str) -> None:
    warnings.simplefilter("ignore")
    _save(path, writer)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stock_dcp_loads_what_the_writer_wrote(tmp_path, world_size):
    path = str(tmp_path / "step-7")
    run_on_ranks(_save_then_load, world_size, {"path": path, "writer": "nxd_ckpt", "readers": ("dcp", "nxd_ckpt")})
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(world_size)
    ]
    manifests = [n for n in os.listdir(os.path.join(path, "nxd_ckpt")) if n.startswith("manifest_rank_")]
    assert len(manifests) == world_size  # one manifest per rank (beside the commit's index and .metadata's record)
    assert sorted(os.listdir(tmp_path)) == ["step-7"]


def test_a_checkpoint_saved_on_4_ranks_loads_on_2(tmp_path):
    path = str(tmp_path / "step-7")
    run_on_ranks(_save_only, 4, {"path": path, "writer": "nxd_ckpt"})
    run_on_ranks(_load_only, 2, {"path": path, "readers": ("dcp", "nxd_ckpt")})


def test_our_reader_reads_what_dcp_wrote(tmp_path):
    path = str(tmp_path / "step-7")
    run_on_ranks(_save_then_load, 2, {"path": path, "writer": "dcp", "readers": ("nxd_ckpt",)})


def _load_expecting_damage(path: str, name: str) -> None:
    warnings.simplefilter("ignore")
    with pytest.raises(CheckpointException) as excinfo:
        _load_and_check(path, ("nxd_ckpt",))
    assert f"{path}/{name} is corrupt" in str(excinfo.value)


def test_a_damaged_rank_file_is_named_on_every_rank(tmp_path):
    path = str(tmp_path / "step-7")
    run_on_ranks(_save_only, 2, {"path": path, "writer": "nxd_ckpt"})
    damaged = os.path.join(path, "__1_0.distcp")
    with open(damaged, "r+b") as f:  # a byte inside the tensor data: torch.load would not notice
        f.seek(os.path.getsize(damaged) - 700)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    run_on_ranks(_load_expecting_damage, 2, {"path": path, "name": "__1_0.distcp"})
