"""Deadlines of nxd_ckpt.dcp on real gloo ranks: a rank that stalls before writing its files makes the
coordinator's commit wait end at the writer's deadline with an error naming that rank (not DCP's process-group
timeout, which names nobody); the save is not committed and the folder keeps its previous checkpoint."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import StorageReader, StorageWriter

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane

DEADLINE_S = 1.0
STALL_S = 3.0


def _state(version: int) -> dict:
    rank = dist.get_rank()
    return {f"rank{rank}": torch.full((64,), float(version + rank)), "step": version}


def _stalled_save(path: str) -> None:
    """Version 1 saved; then rank 1 stalls before writing version 2 into the same folder: every rank's save
    fails naming rank 1, and version 1 still loads."""
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    dcp.save(_state(1), storage_writer=StorageWriter(path, timeout=DEADLINE_S))
    writer = StorageWriter(path, timeout=DEADLINE_S)
    if rank == 1:
        real = writer.write_data

        def stalled(*args: object, **kwargs: object) -> object:
            time.sleep(STALL_S)  # stuck before its files (outside any storage call its own watchdog sees)
            return real(*args, **kwargs)

        writer.write_data = stalled  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as raised:
        dcp.save(_state(2), storage_writer=writer)
    message = str(raised.value)
    assert "committing DCP checkpoint" in message and "waiting for rank(s) [1]" in message, message
    assert f"timed out after {DEADLINE_S:g} s" in message, message
    assert time.monotonic() - started < STALL_S + 5
    loaded = _state(0)
    dcp.load(loaded, storage_reader=StorageReader(path))
    assert loaded["step"] == 1 and torch.equal(loaded[f"rank{rank}"], _state(1)[f"rank{rank}"])


def test_a_stalled_rank_is_named_by_the_commit_deadline_and_the_previous_checkpoint_stays(tmp_path):
    path = str(tmp_path / "step-1")
    run_on_ranks(_stalled_save, 2, {"path": path})
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-1"]
