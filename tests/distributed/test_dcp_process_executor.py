"""``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` through ``nxd_ckpt.dcp``: DCP
pickles the writer to its checkpoint process (one per rank, spawned, its own gloo group), the ``Stager`` stages in
the training process. On 2 spawned gloo ranks: three saves, each changing the state after ``async_save`` returns,
each committed by the checkpoint processes, verified and loaded back bit-exactly through a pickled reader; a writer
with a memory tier is refused with the reason and the remedy; writer, reader and stager pickle to working copies."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import Stager, StorageReader, StorageWriter, verify

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane


def _state(save: int) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(10 * save + rank)
    return {f"rank{rank}.w": torch.randn(256, generator=gen), "shared.b": torch.full((4,), float(save))}


def _expected(save: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _state(save).items()}


def _process_saves(base: str) -> None:
    warnings.simplefilter("ignore")
    stager = Stager(timeout=120)
    for save in (1, 2, 3):
        path = os.path.join(base, f"step-{save}")
        state = _state(save)
        response = dcp.async_save(
            state,
            storage_writer=StorageWriter(path),
            async_stager=stager,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        for value in state.values():
            value.add_(1000.0)  # training goes on: the save holds the values it was called with
        response.upload_completion.result(timeout=300)
    stager.close()
    dist.barrier()
    for save in (1, 2, 3):
        path = os.path.join(base, f"step-{save}")
        if dist.get_rank() == 0:
            assert verify(path).ok, path
        out = {k: torch.zeros_like(v) for k, v in _expected(save).items()}
        reader = pickle.loads(pickle.dumps(StorageReader(path)))
        dcp.load(out, storage_reader=reader)
        for key, value in _expected(save).items():
            assert torch.equal(out[key], value), (path, key)


def test_async_save_through_the_process_executor_and_load_back(tmp_path):
    run_on_ranks(_process_saves, 2, dict(base=str(tmp_path / "ckpt")), timeout=400)


def test_a_writer_or_reader_with_a_memory_tier_is_refused_with_the_remedy(tmp_path):
    tier = nxd.MemoryTier(dir=str(tmp_path / "mem"), replicas=0, max_copies=2)
    for cls in (StorageWriter, StorageReader):
        obj = cls.__new__(cls)  # as built, without starting the tier's runtime (collective)
        obj.path, obj.memory_tier = str(tmp_path / "step-1"), tier
        with pytest.raises(TypeError, match=r"memory_tier.*AsyncCheckpointerType.THREAD"):
            pickle.dumps(obj)


def test_writer_reader_and_stager_pickle_to_working_copies(tmp_path):
    writer = pickle.loads(pickle.dumps(StorageWriter(str(tmp_path / "step-1"), thread_count=2, timeout=30)))
    assert (writer.thread_count, writer.timeout_s, writer.place.folder) == (2, 30, "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(10)}, storage_writer=writer, no_dist=True)
        out = {"a": torch.zeros(10, dtype=torch.int64)}
        dcp.load(out, storage_reader=pickle.loads(pickle.dumps(StorageReader(str(tmp_path / "step-1")))), no_dist=True)
    assert torch.equal(out["a"], torch.arange(10))
    stager = pickle.loads(pickle.dumps(Stager(host_memory_budget="1MiB", timeout=12)))
    assert (stager.host_memory_budget, stager.timeout_s) == (1 << 20, 12)
    staged = stager.stage({"a": torch.ones(3)}).result(timeout=30)
    assert torch.equal(staged["a"], torch.ones(3))
    stager.close()
