"""What users would pick instead of nxd_ckpt, on the same state: ``torch.save``/``torch.load`` in NxD's plain
layout (into fresh dicts and into the live module) and torch.distributed.checkpoint (sync and async)."""

from __future__ import annotations

import time

import torch

from benchmarks.core.files import torch_save_fsynced
from benchmarks.core.ranks import slowest
from benchmarks.core.state import assert_same
from benchmarks.suites.saveload.bench import Bench, Timing, check_live, live, section, with_peak


@section("torch_save", "torch.save / torch.load (NxD plain layout: model on rank 0, a shard per rank)")
def torch_save(b: Bench) -> Timing:
    """``torch.save`` of the model (rank 0) and each rank's optimizer shard, fsynced; ``torch.load`` of both."""
    model_path, optim_path = b.path("ts_model.pt"), b.path(f"ts_optim_{b.rank}.pt")

    def save() -> None:
        if b.rank == 0:
            torch_save_fsynced(b.model, model_path)
        torch_save_fsynced(b.optimizer, optim_path)

    loaded: dict = {}

    def load() -> None:
        loaded["model"] = torch.load(model_path, map_location="cpu", weights_only=True)
        loaded["optim"] = torch.load(optim_path, map_location="cpu", weights_only=True)

    timing = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, loaded["model"], "torch.load model")
    loaded.clear()
    b.clean("ts_model.pt")
    b.clean(f"ts_optim_{b.rank}.pt")
    return timing


@section("torch_load_live", "torch.load + load_state_dict into the live module; torch.load of the optimizer shard")
def torch_load_live(b: Bench) -> Timing:
    """The usual resume without nxd_ckpt: plain files, model copied into the existing module."""
    model_path, optim_path = b.path("tl_model.pt"), b.path(f"tl_optim_{b.rank}.pt")

    def save() -> None:
        if b.rank == 0:
            torch_save_fsynced(b.model, model_path)
        torch_save_fsynced(b.optimizer, optim_path)

    module = live(b)

    def load() -> None:
        module.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
        torch.load(optim_path, map_location="cpu", weights_only=True)

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load)
    timing = with_peak(b, Timing(save_s, load_s), peak)
    check_live(b, module, "torch.load live model")
    b.clean("tl_model.pt")
    b.clean(f"tl_optim_{b.rank}.pt")
    return timing


def _dcp_state(b: Bench) -> dict:
    """The state DCP saves: the model and this rank's optimizer shard under a rank-named key."""
    return {"model": b.model, "optim": {f"rank{b.rank}": b.optimizer["state"]}}


def _dcp_target(b: Bench) -> dict:
    """Empty tensors shaped like the DCP state (model + this rank's optimizer shard), for dcp.load."""
    return {
        "model": {k: torch.empty_like(v) for k, v in b.model.items()},
        "optim": {
            f"rank{b.rank}": {
                i: {k: torch.empty_like(v) for k, v in s.items()} for i, s in b.optimizer["state"].items()
            }
        },
    }


@section("dcp", "torch.distributed.checkpoint save / load (FileSystemWriter, 4 threads)")
def dcp_sync(b: Bench) -> Timing:
    """DCP's save and load of the same state."""
    import torch.distributed.checkpoint as dcp

    path, state, target = b.path("dcp"), _dcp_state(b), _dcp_target(b)
    save_s = b.timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4,
                                                                                   sync_files=True)))  # fmt: skip
    timing = Timing(save_s, b.timed_load(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(path))))
    if b.check:
        assert_same(b.model, target["model"], "DCP model")
    b.clean("dcp")
    return timing


@section("dcp_async", "torch.distributed.checkpoint async_save (save = until its future is done) / load")
def dcp_async(b: Bench) -> Timing:
    """DCP's async_save until its future is done (and the time blocked in the call), then its load."""
    import torch.distributed.checkpoint as dcp

    path, state, target = b.path("dcp_async"), _dcp_state(b), _dcp_target(b)
    blocked: dict[str, float] = {}

    def save() -> None:
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(path, thread_count=4, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer)
        blocked["s"] = time.perf_counter() - start
        future.result()  # before any other collective: DCP's background thread uses the default group

    save_s = b.timed(save)
    load_s = b.timed_load(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(path)))
    timing = Timing(save_s, load_s, {"blocked_s": slowest(blocked["s"])})
    if b.check:
        assert_same(b.model, target["model"], "DCP async model")
    b.clean("dcp_async")
    return timing
