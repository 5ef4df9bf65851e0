"""DCP checkpoints on s3:// (the loopback S3-protocol server): ``nxd_ckpt.dcp.StorageWriter`` / ``StorageReader``
write and read stock DCP files with the library's manifests, a damaged object is named on load, a complete folder
is never overwritten in place; ``nxd_ckpt.torchtitan.CheckpointManager`` with an ``s3://`` folder saves (sync and
through the Stager), applies ``keep_latest_k`` and resumes bit-exactly."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nxd_ckpt.dcp
from harness import titan_job
from harness.titan_job import TitanJob, assert_same_state
from nxd_ckpt.storage.s3 import S3Storage

pytestmark = [pytest.mark.s3, pytest.mark.device_independent]


@pytest.fixture(scope="module", autouse=True)
def _gloo_world_of_one() -> Iterator[None]:
    with titan_job.gloo_world_of_one():
        yield


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}, "step": seed}


def _zeros() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "step": 0}


def test_writer_and_reader_round_trip_in_the_stock_layout(s3_url):
    folder = f"{s3_url}/step-1"
    saved = _state(1)
    dcp.save(saved, storage_writer=nxd_ckpt.dcp.StorageWriter(folder, thread_count=2))
    files = sorted(S3Storage(s3_url).walk_files("step-1"))
    assert files == [
        "step-1/.metadata",
        "step-1/__0_0.distcp",
        "step-1/__0_1.distcp",
        "step-1/nxd_ckpt/dcp_index.json",
        "step-1/nxd_ckpt/dcp_metadata.json",
        "step-1/nxd_ckpt/manifest_rank_00000.json",
    ]
    metadata = pickle.loads(S3Storage(s3_url).read_bytes("step-1/.metadata"))  # DCP's own metadata
    assert {i.relative_path for i in metadata.storage_data.values()} == {"__0_0.distcp", "__0_1.distcp"}
    loaded = _zeros()
    dcp.load(loaded, storage_reader=nxd_ckpt.dcp.StorageReader(folder))
    assert loaded["step"] == 1 and all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items())
    assert nxd_ckpt.dcp.verify(folder).ok


def test_a_damaged_object_is_named_on_load(s3_url):
    folder = f"{s3_url}/step-1"
    dcp.save(_state(1), storage_writer=nxd_ckpt.dcp.StorageWriter(folder))
    storage = S3Storage(s3_url)
    data = bytearray(storage.read_bytes("step-1/__0_0.distcp"))
    data[-100] ^= 0x10  # inside a tensor's bytes: torch.load would not notice
    storage.write_bytes("step-1/__0_0.distcp", bytes(data))
    with pytest.raises(CheckpointException) as raised:
        dcp.load(_zeros(), storage_reader=nxd_ckpt.dcp.StorageReader(folder))
    assert f"{folder}/__0_0.distcp is corrupt" in str(raised.value) and "checksum" in str(raised.value)
    assert "IntegrityError" in str(raised.value)
    assert not nxd_ckpt.dcp.verify(folder).ok


def test_a_complete_folder_is_not_overwritten_in_place(s3_url):
    """S3 cannot rename folders, so a re-save into a complete folder is refused and the checkpoint stays."""
    folder = f"{s3_url}/step-1"
    dcp.save(_state(1), storage_writer=nxd_ckpt.dcp.StorageWriter(folder))
    with pytest.raises(CheckpointException, match="already holds a complete DCP checkpoint"):
        dcp.save(_state(2), storage_writer=nxd_ckpt.dcp.StorageWriter(folder))
    loaded = _zeros()
    dcp.load(loaded, storage_reader=nxd_ckpt.dcp.StorageReader(folder))
    assert loaded["step"] == 1


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_the_torchtitan_manager_saves_to_s3_keeps_the_latest_k_and_resumes(s3_url, async_mode):
    pytest.importorskip(
        "torchtitan.components.checkpointer", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]')"
    )
    from nxd_ckpt.torchtitan import CheckpointManager

    folder = f"{s3_url}/ckpt"

    def config(**fields: Any) -> Any:
        return CheckpointManager.Config(enable=True, folder=folder, last_save_model_only=False, **fields)

    job = TitanJob(config(interval=1, keep_latest_k=2, async_mode=async_mode), seed=0)
    job.train(4)
    job.checkpointer.close()
    storage = S3Storage(folder)
    assert storage.list_dir("") == ["step-3", "step-4"]  # keep_latest_k on S3
    assert sorted(storage.walk_files("step-4")) == [
        "step-4/.metadata",
        "step-4/__0_0.distcp",
        "step-4/nxd_ckpt/dcp_index.json",
        "step-4/nxd_ckpt/dcp_metadata.json",
        "step-4/nxd_ckpt/manifest_rank_00000.json",
    ]
    assert nxd_ckpt.dcp.verify(f"{folder}/step-4").ok
    resumed = TitanJob(config(), seed=1)
    assert resumed.checkpointer.load()
    assert_same_state(job.state(), resumed.state())
    resumed.checkpointer.close()
