"""nxd_ckpt.dcp's one commit round on real gloo ranks: each rank's records reach the coordinator's commit through
DCP's gather (the commit writes one index listing every rank's files; stock DCP reads the checkpoint), and a rank
that fails anywhere in the save, before its ``write_data`` too, fails the save on every rank at once, naming it,
not at the writer's deadline; the previous checkpoint stays."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.format.manifests import parse_index

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane

DEADLINE_S = 120.0
"""The writer's deadline: far longer than a failure may take to reach every rank."""
FAST_S = 30.0


def _state(version: int) -> dict:
    rank = dist.get_rank()
    return {f"rank{rank}": torch.full((64,), float(version + rank)), "step": version}


class _FailsBeforeWriting(DefaultSavePlanner):
    """DCP's planner, failing on rank 1 as DCP's write step begins (before the writer's ``write_data``)."""

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 ran out of host memory")
        return super().finish_plan(new_plan)


class _FailsPlanning(DefaultSavePlanner):
    """DCP's planner, failing on rank 1 while it plans."""

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot plan")
        return super().create_local_plan()


def _failing_save(path: str, where: str) -> None:
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    dcp.save(_state(1), storage_writer=StorageWriter(path, timeout=DEADLINE_S))
    planner = _FailsBeforeWriting() if where == "writing" else _FailsPlanning()
    started = time.monotonic()
    with pytest.raises(CheckpointException) as raised:
        dcp.save(_state(2), storage_writer=StorageWriter(path, timeout=DEADLINE_S), planner=planner)
    elapsed = time.monotonic() - started
    assert elapsed < FAST_S, f"rank {rank} learnt of rank 1's failure after {elapsed:.1f} s"
    assert list(raised.value.failures) == [1] and "rank 1" in str(raised.value), raised.value
    dist.barrier()
    loaded = {f"rank{rank}": torch.zeros(64), "step": -1}
    dcp.load(loaded, storage_reader=StorageReader(path))
    assert loaded["step"] == 1 and torch.equal(loaded[f"rank{rank}"], _state(1)[f"rank{rank}"])
    dcp.save(_state(3), storage_writer=StorageWriter(path, timeout=DEADLINE_S))  # the next save works
    deadline = time.monotonic() + FAST_S  # and no wait of the failed save lingers until its deadline
    while any(t.name == "nxd_dcp_checkin" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "nxd_dcp_checkin" for t in threading.enumerate())


@pytest.mark.parametrize("where", ["writing", "planning"])
def test_a_rank_failing_before_its_writes_fails_every_rank_at_once(tmp_path, where):
    path = str(tmp_path / "step-1")
    run_on_ranks(_failing_save, 2, {"path": path, "where": where})
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-1"]


def _save_and_load(path: str) -> None:
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    dcp.save(_state(3), storage_writer=StorageWriter(path))
    for reader in (StorageReader(path), dcp.FileSystemReader(path)):
        loaded = {f"rank{rank}": torch.zeros(64), "step": -1}
        dcp.load(loaded, storage_reader=reader)
        assert loaded["step"] == 3 and torch.equal(loaded[f"rank{rank}"], _state(3)[f"rank{rank}"])


def test_the_commit_indexes_every_ranks_files_in_one_file(tmp_path):
    path = tmp_path / "step-3"
    run_on_ranks(_save_and_load, 2, {"path": str(path)})
    index = parse_index((path / "nxd_ckpt" / "dcp_index.json").read_bytes(), "index")
    assert {rel: rec.rank for rel, rec in index.items()} == {".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}
    for rel, rec in index.items():
        assert rec.size == os.path.getsize(path / rel), rel
