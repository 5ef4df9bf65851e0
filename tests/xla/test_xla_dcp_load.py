"""nxd_ckpt.dcp.StorageReader into state on the XLA device (issue 53): a load is bit-exact, and a flipped byte leaves
every device target as it was (checked before any host -> device copy), naming the file."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: runs in the XLA lane")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from nxd_ckpt.dcp import StorageReader, StorageWriter  # noqa: E402


def _state(seed: int, device) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)).to(device)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    torch_xla.sync()
    return state


def test_a_load_onto_the_device_is_bit_exact_and_damage_changes_nothing(tmp_path):
    device = torch_xla.device()
    path = str(tmp_path / "step-1")
    saved = _state(0, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, storage_writer=StorageWriter(path), no_dist=True)
        live = _state(1, device)
        dcp.load(live, storage_reader=StorageReader(path), no_dist=True)
        torch_xla.sync()
        assert all(torch.equal(live[k].cpu(), saved[k].cpu()) for k in saved)
        metadata = dcp.FileSystemReader(path).read_metadata()
        (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == "1.weight"]
        file = os.path.join(path, info.relative_path)
        with open(file, "r+b") as f:
            f.seek(info.offset + info.length // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        live = _state(2, device)
        before = {k: v.cpu().clone() for k, v in live.items()}
        with pytest.raises(CheckpointException, match=f"{info.relative_path} is corrupt"):
            dcp.load(live, storage_reader=StorageReader(path), no_dist=True)
    torch_xla.sync()
    assert all(torch.equal(live[k].cpu(), before[k]) for k in before)
