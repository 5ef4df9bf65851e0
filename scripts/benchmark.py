"""Save/load throughput of nxd_ckpt against the disk and the alternatives users would pick.

Run (2 ranks, 2 GiB of tensor data, 3 interleaved repetitions):
    $(bash scripts/setup_env.sh cpu | tail -1) scripts/benchmark.py --size-gb 2 --ranks 2 --reps 3
    PJRT_DEVICE=CPU $(bash scripts/setup_env.sh xla | tail -1) scripts/benchmark.py ...   # adds the torch_xla rows

State (as in ../shared/docs/baselines.md): a transformer-like fp32 model replicated on every rank (DP = --ranks)
plus AdamW ``exp_avg``/``exp_avg_sq`` split ZeRO-1 style; model + all optimizer shards = --size-gb. Throughput
is that total divided by the time from a barrier before the step to a barrier after it (so: the slowest rank).
Saves are timed to durability (every file fsynced); the page cache is dropped before every load (cold reads;
needs root, otherwise the table says "warm"). A load ends with every rank holding the model and its own
optimizer shard. Sections run interleaved (rotated order each repetition); the table shows medians and ratios
to the raw disk rows measured in the same run, since absolute numbers on this shared machine move 2-5x.

Sections are functions registered with ``@section``; each returns the save and load seconds. To add one (e.g.
an "async" section), write ``@section("name", "label") def _(b: Bench) -> Timing`` using ``b.timed``.
The async sections (``nxd_async``, ``dcp_async``) time the save until durable and also record the time
blocked in the call, and ``nxd_async`` a memcpy of the rank's saved bytes; the report ends with their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchlib import (
    S3_BUCKET,
    S3_TITLE,
    SECTIONS,
    Bench,
    PeakRSS,
    Timing,
    apply_loopback_s3_env,
    assert_same,
    check_live,
    dist_all_gather,
    fsync_tree,
    live,
    nbytes_of,
    save_fsynced,
    section,
    tensors_of,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the test harness, harness/

GIB = 1 << 30
BLOCK = 64 << 20


# ----------------------------------------------------------------------------------------------- state


def build_state(total_bytes: int, rank: int, world: int, hidden: int) -> tuple[dict, dict]:
    """A replicated fp32 model and this rank's ZeRO-1 shard of AdamW state; model + all shards = total_bytes."""
    shapes = {"qkv.weight": (3 * hidden, hidden), "proj.weight": (hidden, hidden), "fc1.weight": (4 * hidden, hidden)}
    shapes |= {"fc2.weight": (hidden, 4 * hidden), "ln1.weight": (hidden,), "ln2.weight": (hidden,)}
    shapes |= {"fc1.bias": (4 * hidden,), "fc2.bias": (hidden,), "proj.bias": (hidden,)}
    per_layer = sum(torch.Size(s).numel() for s in shapes.values()) * 4
    layers = max(1, round(total_bytes / 3 / per_layer))
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.{k}": torch.rand(s, generator=gen) for i in range(layers) for k, s in shapes.items()}
    shard_gen = torch.Generator().manual_seed(1 + rank)
    state = {}
    for i, t in enumerate(model.values()):
        shard = -(-t.numel() // world)
        state[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.rand(shard, generator=shard_gen),
            "exp_avg_sq": torch.rand(shard, generator=shard_gen),
        }
    optimizer = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": list(state)}]}
    return model, optimizer


# ----------------------------------------------------------------------------------------------- sections


@section("raw_dd", "disk: dd O_DIRECT+fdatasync / cold dd read")
def _raw_dd(b: Bench) -> Timing:
    """The physical limit: each rank streams its share of the bytes with dd (no page cache on the write)."""
    name = f"raw_dd_{b.rank}"
    count = max(1, round(b.total_bytes / b.world / BLOCK))
    out = b.path(name)

    def write() -> None:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={out}", f"bs={BLOCK}", f"count={count}", "oflag=direct", "conv=fdatasync"],
            check=True,
            stderr=subprocess.DEVNULL,
        )

    def read() -> None:
        subprocess.run(["dd", f"if={out}", "of=/dev/null", f"bs={BLOCK}"], check=True, stderr=subprocess.DEVNULL)

    scale = b.total_bytes / (count * BLOCK * b.world)  # report per total_bytes
    timing = Timing(b.timed(write) * scale, b.timed_load(read) * scale)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    return timing


@section("raw_buffered", "disk: buffered write+fsync / cold read (Python, 64 MiB blocks)")
def _raw_buffered(b: Bench) -> Timing:
    """What a library can hope for through the page cache: large writes from touched memory, then fsync."""
    share = b.total_bytes // b.world
    buf = torch.ones(min(share, BLOCK), dtype=torch.uint8).numpy()
    out = b.path(f"raw_buffered_{b.rank}")

    def write() -> None:
        with open(out, "wb", buffering=0) as f:
            left = share
            while left > 0:
                left -= f.write(memoryview(buf)[: min(left, len(buf))])
            os.fsync(f.fileno())

    def read() -> None:
        with open(out, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    timing = Timing(b.timed(write), b.timed_load(read))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    return timing


@section("torch_save", "torch.save / torch.load (NxD plain layout: model on rank 0, a shard per rank)")
def _torch_save(b: Bench) -> Timing:
    model_path, optim_path = b.path("ts_model.pt"), b.path(f"ts_optim_{b.rank}.pt")

    def save() -> None:
        if b.rank == 0:
            save_fsynced(b.model, model_path)
        save_fsynced(b.optimizer, optim_path)

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
def _dcp(b: Bench) -> Timing:
    import torch.distributed.checkpoint as dcp

    path = b.path("dcp")
    state = {"model": b.model, "optim": {f"rank{b.rank}": b.optimizer["state"]}}

    def save() -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4, sync_files=True))

    target = _dcp_target(b)

    def load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))

    timing = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, target["model"], "DCP model")
    b.clean("dcp")
    return timing


@section("dcp_async", "torch.distributed.checkpoint async_save (save = until its future is done) / load")
def _dcp_async(b: Bench) -> Timing:
    import torch.distributed.checkpoint as dcp

    path = b.path("dcp_async")
    state = {"model": b.model, "optim": {f"rank{b.rank}": b.optimizer["state"]}}
    blocked: dict[str, float] = {}

    def save() -> None:
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(path, thread_count=4, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer)
        blocked["s"] = time.perf_counter() - start
        future.result()  # before any other collective: DCP's background thread uses the default group

    target = _dcp_target(b)

    def load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))

    timing = Timing(b.timed(save), b.timed_load(load), {"blocked_s": max(dist_all_gather(blocked["s"]))})
    if b.check:
        assert_same(b.model, target["model"], "DCP async model")
    b.clean("dcp_async")
    return timing


_MEMCPY_BUFFERS: dict[int, torch.Tensor] = {}


def _memcpy_s(b: Bench, tensors: list[torch.Tensor]) -> float:
    """Slowest rank's time to copy ``tensors`` into an already-allocated, already-touched host buffer."""
    nbytes = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    if nbytes not in _MEMCPY_BUFFERS:
        _MEMCPY_BUFFERS.clear()
        _MEMCPY_BUFFERS[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
    flat, views, offset = _MEMCPY_BUFFERS[nbytes], [], 0
    for t in tensors:  # each destination 64-byte aligned, as separately allocated tensors are
        n = t.numel() * t.element_size()
        views.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
        offset += -(-n // 64) * 64
    dist.barrier()
    start = time.perf_counter()
    for dst, src in zip(views, tensors, strict=True):
        dst.copy_(src)
    return max(dist_all_gather(time.perf_counter() - start))


@section("nxd_async", "nxd_ckpt async_save=True plain (save = until durable and committed), load(verify=False)")
def _nxd_async(b: Bench) -> Timing:
    """Also times the call alone (blocked) and a memcpy of this rank's saved bytes (its target)."""
    import nxd_ckpt as nxd

    path = b.path("nxd_async")
    saved = (tensors_of(b.model) if b.rank == 0 else []) + tensors_of(b.optimizer)  # DP rank 0 saves the model
    memcpy_s = _memcpy_s(b, saved)
    figures: dict[str, float] = {}

    def save() -> None:
        start = time.perf_counter()
        report = nxd.save_checkpoint(
            path, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True, async_save=True
        )
        figures["blocked_s"], figures["staging_s"] = time.perf_counter() - start, report.staging_s
        report.wait()  # rank 0: 'done' written; other ranks: the commit outcome is known

    model_out: dict = {}
    optim_out: dict = {}

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=model_out, optimizer=optim_out, verify=False)

    save_s = b.timed(save)
    extra = {k: max(dist_all_gather(v)) for k, v in figures.items()} | {"memcpy_s": memcpy_s}
    timing = Timing(save_s, b.timed_load(load), extra)
    if b.check:
        assert_same(b.model, model_out, "nxd_async model")
        assert_same(b.optimizer, optim_out, "nxd_async optimizer")
    b.clean("nxd_async")
    return timing


def _nxd(b: Bench, name: str, *, use_xser: bool, verify: bool, device: str | None = None) -> Timing:
    import nxd_ckpt as nxd

    model, optimizer = b.model, b.optimizer
    if device is not None:  # the state lives on the XLA device, as in training
        model, optimizer = _to_device(b, device)
    path = b.path(name)

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=model, optimizer=optimizer, use_xser=use_xser, zero1_optimizer=True)

    model_out: dict = {}
    optim_out: dict = {}

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=model_out, optimizer=optim_out, verify=verify)

    timing = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, model_out, f"{name} model")
        assert_same(b.optimizer, optim_out, f"{name} optimizer")
    model_out.clear()
    optim_out.clear()
    b.clean(name)
    return timing


@section("nxd_xser", "nxd_ckpt use_xser=True (defaults: checksums written and verified)")
def _nxd_xser(b: Bench) -> Timing:
    return _nxd(b, "nxd_xser", use_xser=True, verify=True)


@section("nxd_xser_noverify", "nxd_ckpt use_xser=True, load(verify=False)")
def _nxd_xser_noverify(b: Bench) -> Timing:
    return _nxd(b, "nxd_xser_nv", use_xser=True, verify=False)


@section("nxd_plain", "nxd_ckpt plain (one torch.save file per state file), load(verify=False)")
def _nxd_plain(b: Bench) -> Timing:
    return _nxd(b, "nxd_plain", use_xser=False, verify=False)


def _have_torch_xla() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


_device_cache: dict[str, tuple[dict, dict]] = {}


def _to_device(b: Bench, device: str) -> tuple[dict, dict]:
    """The state moved to the XLA device once per process (as it lives there during training)."""
    if device not in _device_cache:
        import torch_xla

        from nxd_ckpt.tree import map_tensors

        dev = torch_xla.device()
        _device_cache[device] = (
            map_tensors(b.model, lambda t: t.to(dev)),
            map_tensors(b.optimizer, lambda t: t.to(dev)),
        )
        torch_xla.sync()
    return _device_cache[device]


@section("torch_xla_xser", "torch_xla xser.save (XLA tensors) +fsync / xser.load to CPU", _have_torch_xla)
def _torch_xla_xser(b: Bench) -> Timing:
    import torch_xla.utils.serialization as xser

    model, optimizer = _to_device(b, "xla")
    directory = b.path("txser")
    model_path, optim_path = os.path.join(directory, "model.pt"), os.path.join(directory, f"optim_{b.rank}.pt")
    os.makedirs(directory, exist_ok=True)

    def save() -> None:
        if b.rank == 0:
            xser.save(model, model_path, master_only=False)
            fsync_tree(model_path + ".tensors")
            fsync_tree(directory)
        xser.save(optimizer, optim_path, master_only=False)
        fsync_tree(optim_path + ".tensors")
        fsync_tree(directory)

    loaded: dict = {}

    def load() -> None:
        loaded["model"] = xser.load(model_path)
        loaded["optim"] = xser.load(optim_path)

    timing = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, loaded["model"], "torch_xla xser model")
    loaded.clear()
    b.clean("txser")
    return timing


@section("nxd_xser_from_xla", "nxd_ckpt use_xser=True from XLA tensors, load(verify=False) to CPU", _have_torch_xla)
def _nxd_xser_from_xla(b: Bench) -> Timing:
    return _nxd(b, "nxd_xser_xla", use_xser=True, verify=False, device="xla")


# ----------------------------------------------------------------------------------------------- resume


def _peak_gb(b: Bench, peak: PeakRSS) -> float:
    """The largest peak extra host memory (heap in use or new resident pages) among the ranks, in GB."""
    return max(dist_all_gather(peak.extra)) / 1e9


@section("torch_load_live", "torch.load + load_state_dict into the live module; torch.load of the optimizer shard")
def _torch_load_live(b: Bench) -> Timing:
    """The usual resume without nxd_ckpt: plain files, model copied into the existing module."""
    model_path, optim_path = b.path("tl_model.pt"), b.path(f"tl_optim_{b.rank}.pt")

    def save() -> None:
        if b.rank == 0:
            save_fsynced(b.model, model_path)
        save_fsynced(b.optimizer, optim_path)

    module = live(b)

    def load() -> None:
        module.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
        torch.load(optim_path, map_location="cpu", weights_only=True)

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load)
    timing = Timing(save_s, load_s)
    timing.extra["peak_gb"] = _peak_gb(b, peak)
    timing.extra["peak_rss_gb"] = max(dist_all_gather(peak.extra_rss)) / 1e9
    check_live(b, module, "torch.load live model")
    b.clean("tl_model.pt")
    b.clean(f"tl_optim_{b.rank}.pt")
    return timing


def _nxd_live(b: Bench, name: str, *, device: str | None = None) -> Timing:
    """nxd_ckpt xser save, then a verified cold load into the live module (and the optimizer shard into {})."""
    import nxd_ckpt as nxd

    model, optimizer = b.model, b.optimizer
    if device is not None:
        model, optimizer = _to_device(b, device)
    path = b.path(name)

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=model, optimizer=optimizer, use_xser=True, zero1_optimizer=True)

    module = live(b, device)

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=module, optimizer={})

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load)
    timing = Timing(save_s, load_s)
    timing.extra["peak_gb"] = _peak_gb(b, peak)
    timing.extra["peak_rss_gb"] = max(dist_all_gather(peak.extra_rss)) / 1e9
    check_live(b, module, f"{name} live model")
    b.clean(name)
    return timing


@section("nxd_xser_live", "nxd_ckpt use_xser=True, verified load into the live module (optimizer into {})")
def _nxd_xser_live(b: Bench) -> Timing:
    return _nxd_live(b, "nxd_xser_live")


@section("nxd_xser_fresh", "nxd_ckpt use_xser=True, verified load into fresh dicts (peak RSS measured)")
def _nxd_xser_fresh(b: Bench) -> Timing:
    import nxd_ckpt as nxd

    path = b.path("nxd_xser_fresh")

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=b.model, optimizer=b.optimizer, use_xser=True, zero1_optimizer=True)

    out: dict = {}

    def load() -> None:
        out["model"], out["optim"] = {}, {}
        nxd.load_checkpoint(path, "step_1", model=out["model"], optimizer=out["optim"])

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load, reset=out.clear)
    timing = Timing(save_s, load_s)
    timing.extra["peak_gb"] = _peak_gb(b, peak)
    timing.extra["peak_rss_gb"] = max(dist_all_gather(peak.extra_rss)) / 1e9
    if b.check:
        assert_same(b.model, out["model"], "nxd_xser_fresh model")
    out.clear()
    b.clean("nxd_xser_fresh")
    return timing


@section(
    "torch_xla_xser_live",
    "torch_xla xser.load + load_state_dict into the live module on the XLA device",
    _have_torch_xla,
)
def _torch_xla_xser_live(b: Bench) -> Timing:
    import torch_xla
    import torch_xla.utils.serialization as xser

    model, optimizer = _to_device(b, "xla")
    directory = b.path("txser_live")
    model_path, optim_path = os.path.join(directory, "model.pt"), os.path.join(directory, f"optim_{b.rank}.pt")
    os.makedirs(directory, exist_ok=True)

    def save() -> None:
        if b.rank == 0:
            xser.save(model, model_path, master_only=False)
            fsync_tree(model_path + ".tensors")
        xser.save(optimizer, optim_path, master_only=False)
        fsync_tree(optim_path + ".tensors")
        fsync_tree(directory)

    module = live(b, "xla")

    def load() -> None:
        module.load_state_dict(xser.load(model_path))
        xser.load(optim_path)
        torch_xla.sync()

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load)
    timing = Timing(save_s, load_s)
    timing.extra["peak_gb"] = _peak_gb(b, peak)
    timing.extra["peak_rss_gb"] = max(dist_all_gather(peak.extra_rss)) / 1e9
    check_live(b, module, "torch_xla xser live model")
    torch_xla.sync()
    b.clean("txser_live")
    return timing


@section(
    "nxd_xser_live_xla", "nxd_ckpt use_xser=True, verified load into the live module on the XLA device", _have_torch_xla
)
def _nxd_xser_live_xla(b: Bench) -> Timing:
    timing = _nxd_live(b, "nxd_xser_live_xla", device="xla")
    import torch_xla

    torch_xla.sync()
    return timing


def _sync_save_retention(b: Bench, name: str, keep: bool) -> Timing:
    """A synchronous xser save over an existing tag; with ``keep`` the previous tag is deleted by retention
    (num_kept_ckpts=1), without it the previous tag is deleted after the timing."""
    import nxd_ckpt as nxd

    path = b.path(name)
    nxd.save_checkpoint(path, "old", model=b.model, optimizer=b.optimizer, use_xser=True, zero1_optimizer=True)
    dist.barrier()

    def save() -> None:
        nxd.save_checkpoint(
            path,
            "new",
            model=b.model,
            optimizer=b.optimizer,
            use_xser=True,
            zero1_optimizer=True,
            num_kept_ckpts=1 if keep else None,
        )

    save_s = b.timed(save)
    nxd.finalize_checkpoint()  # untimed: retention's deletions finish before the next section
    if b.rank == 0 and not keep:
        shutil.rmtree(os.path.join(path, "old"), ignore_errors=True)
    b.clean(name)
    return Timing(save_s, None)


@section("nxd_save_keep", "nxd_ckpt sync xser save, num_kept_ckpts=1 (deletes the previous tag)")
def _nxd_save_keep(b: Bench) -> Timing:
    return _sync_save_retention(b, "nxd_keep", keep=True)


@section("nxd_save_nokeep", "nxd_ckpt sync xser save, no retention")
def _nxd_save_nokeep(b: Bench) -> Timing:
    return _sync_save_retention(b, "nxd_nokeep", keep=False)


# ----------------------------------------------------------------------------------------------- S3 (loopback)


_server: Any = None  # the run's MotoServer, started by rank 0 on first use


def _s3_available() -> bool:
    """The ``s3_loopback`` section runs only with ``NXD_CKPT_BENCH_S3=1`` (moto is slow) and boto3 + moto."""
    if os.environ.get("NXD_CKPT_BENCH_S3") != "1":
        return False
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


def _ensure_server(rank: int) -> None:
    """Rank 0 starts the loopback server once per run; every rank points the AWS environment at it."""
    global _server
    import atexit

    import boto3

    from harness.s3server import MotoServer

    endpoint = [None]
    if rank == 0:
        if _server is None:
            _server = MotoServer().start()
            atexit.register(_server.stop)
            apply_loopback_s3_env(_server.endpoint_url)
            boto3.session.Session().client("s3").create_bucket(Bucket=S3_BUCKET)
        endpoint = [_server.endpoint_url]
    dist.broadcast_object_list(endpoint, src=0)
    apply_loopback_s3_env(str(endpoint[0]))


@section(
    "s3_loopback",
    f"{S3_TITLE}: nxd_ckpt plain to s3://, load(verify=False) (loopback, not AWS S3)",
    _s3_available,
)
def _s3_loopback(b: Bench) -> Timing:
    """Every rank saves its state to ``s3://`` on the loopback server and loads it back (unverified)."""
    import nxd_ckpt as nxd
    from nxd_ckpt.storage.s3 import S3Storage

    _ensure_server(b.rank)
    url = f"s3://{S3_BUCKET}/bench"
    model_out: dict = {}
    optim_out: dict = {}

    def save() -> None:
        nxd.save_checkpoint(url, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True)

    def load() -> None:
        nxd.load_checkpoint(url, "step_1", model=model_out, optimizer=optim_out, verify=False)

    result = Timing(b.timed(save), b.timed(load))  # nothing to drop: moto holds objects in memory
    if b.check:
        assert_same(b.model, model_out, "s3_loopback model")
        assert_same(b.optimizer, optim_out, "s3_loopback optimizer")
    dist.barrier()
    if b.rank == 0:
        S3Storage(url).delete_tree("step_1")
    dist.barrier()
    return result


# Registered after the sections above: the registry's order is --sections' default and the report's.
import benchmark_memory_sections  # noqa: E402 - host memory, first async save, verified plain loads, memory tier

# ----------------------------------------------------------------------------------------------- driver


def _worker(rank: int, args: argparse.Namespace, port: int, root: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.ranks))
    from harness import rendezvous

    rendezvous.init_process_group(port, rank, args.ranks)
    total = int(args.size_gb * GIB)
    model, optimizer = build_state(total, rank, args.ranks, args.hidden)
    saved = nbytes_of(model) + sum(o for o in dist_all_gather(nbytes_of(optimizer)))
    cold = os.geteuid() == 0 and not args.warm
    bench = Bench(rank, args.ranks, root, model, optimizer, saved, cold)
    names = [n for n in args.sections if SECTIONS[n][2]()]
    results: dict[str, list[Timing]] = {n: [] for n in names}
    bench.check = True
    # The process's first async save, before anything else (it is the one-time set-up being measured).
    first_async = benchmark_memory_sections.first_async_save(bench) if "nxd_memory" in names else None
    # Warm-up (untimed): first-touch of memory and imports would otherwise land on whichever section runs first.
    for name in names if args.warmup else []:
        SECTIONS[name][1](bench)
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            timing = SECTIONS[name][1](bench)
            results[name].append(timing)
            if rank == 0:
                load = f"{timing.load_s:.2f} s" if timing.load_s is not None else "-"
                print(f"[rep {rep}] {name}: save {timing.save_s:.2f} s, load {load}", flush=True)
            bench.check = False  # verified once per section is enough
        bench.check = rep == 0
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "bytes": saved,
                    "cold": cold,
                    "first_async": first_async,
                    "results": {n: [[t.save_s, t.load_s] for t in ts] for n, ts in results.items()},
                    "extra": {n: [t.extra for t in ts] for n, ts in results.items() if ts and ts[0].extra},
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


def report(data: dict, args: argparse.Namespace) -> str:
    gb = data["bytes"] / 1e9
    med = {n: (_median([t[0] for t in ts]), _median([t[1] for t in ts])) for n, ts in data["results"].items()}
    base_w, base_r = med.get("raw_dd", (None, None))
    lines = [
        f"state: {data['bytes'] / GIB:.2f} GiB of tensor data ({gb:.2f} GB), {args.ranks} ranks, "
        f"{args.reps} reps (median), loads {'cold (page cache dropped)' if data['cold'] else 'WARM'}, "
        f"torch {torch.__version__}",
        "",
        "| system | save s | save GB/s | x disk write | load s | load GB/s | x disk read |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (s, ld) in med.items():
        label = SECTIONS[name][0]
        xw = f"{base_w / s:.2f}" if base_w else ""
        if ld is None:
            lines.append(f"| {label} | {s:.2f} | {gb / s:.2f} | {xw} | - | - | - |")
            continue
        xr = f"{base_r / ld:.2f}" if base_r else ""
        lines.append(f"| {label} | {s:.2f} | {gb / s:.2f} | {xw} | {ld:.2f} | {gb / ld:.2f} | {xr} |")
    lines.append("")
    for name, ts in data["results"].items():
        saves = ", ".join(f"{t[0]:.2f}" for t in ts)
        loads = ", ".join(f"{t[1]:.2f}" if t[1] is not None else "-" for t in ts)
        lines.append(f"- {name}: save [{saves}] s, load [{loads}] s")
    lines += _resume_report(data, med)
    if "nxd_xser" in med and med["nxd_xser"][1] is not None:
        s, ld = med["nxd_xser"]
        lines.append("")
        for other in ("torch_xla_xser", "dcp", "torch_save"):
            if other in med:
                lines.append(
                    f"nxd_xser vs {other}: save {med[other][0] / s:.2f}x faster, load {med[other][1] / ld:.2f}x faster"
                )
    lines += _async_report(data, med)
    lines += benchmark_memory_sections.report_lines(data, med)
    return "\n".join(lines)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _resume_report(data: dict, med: dict[str, tuple[float | None, float | None]]) -> list[str]:
    """The resume targets: cold load into the live module >= 1.0x torch.load + load_state_dict and >= 0.9x dd;
    onto the device >= 1.0x torch_xla's xser.load + load_state_dict; a sync save with retention no slower."""
    lines = [""]

    def ratio(faster: str, slower: str, col: int) -> str | None:
        if faster in med and slower in med and med[faster][col] and med[slower][col]:
            return f"{med[slower][col] / med[faster][col]:.2f}x"
        return None

    for mine, other, what, col in (
        ("nxd_xser_live", "torch_load_live", "live-module load vs torch.load + load_state_dict (target >= 1.0)", 1),
        ("nxd_xser_live", "raw_dd", "live-module load vs cold dd read (target >= 0.9)", 1),
        ("nxd_xser_fresh", "raw_dd", "fresh-dict load vs cold dd read", 1),
        ("nxd_xser_live", "nxd_xser_fresh", "live-module load vs fresh-dict load", 1),
        ("nxd_xser_live_xla", "torch_xla_xser_live", "device load vs xser.load + load_state_dict (target >= 1.0)", 1),
        ("nxd_save_keep", "nxd_save_nokeep", "sync save with retention vs without (target >= 1.0 beyond noise)", 0),
    ):
        r = ratio(mine, other, col)
        if r is not None:
            lines.append(f"resume: {what}: {r}")
    extra = data.get("extra", {})
    for name in ("torch_load_live", "nxd_xser_live", "nxd_xser_fresh", "torch_xla_xser_live", "nxd_xser_live_xla"):
        if name in extra:
            peaks = [r["peak_gb"] for r in extra[name] if "peak_gb" in r]
            if peaks:
                rss = [r.get("peak_rss_gb", 0.0) for r in extra[name]]
                lines.append(
                    f"resume: {name}: peak extra host memory during the load (largest rank; heap or new pages) median "
                    f"{statistics.median(peaks):.3f} GB [{', '.join(f'{p:.3f}' for p in peaks)}], new resident "
                    f"pages {statistics.median(rss):.3f} GB"
                )
    return lines if len(lines) > 1 else []


def _async_report(data: dict, med: dict[str, tuple[float, float]]) -> list[str]:
    """The async targets: blocked <= 1.25x memcpy and below DCP's async_save; total <= 1.1x the sync save."""
    extra = data.get("extra", {})
    if "nxd_async" not in extra:
        return []
    runs = extra["nxd_async"]
    a = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    paired = statistics.median(r["blocked_s"] / r["memcpy_s"] for r in runs)
    lines = [
        "",
        f"async: nxd async_save blocks {a['blocked_s']:.3f} s (staging {a['staging_s']:.3f} s); memcpy of the same "
        f"bytes into a touched buffer {a['memcpy_s']:.3f} s: blocked / memcpy {a['blocked_s'] / a['memcpy_s']:.2f} "
        f"(median per repetition {paired:.2f}; target <= 1.25)",
    ]
    if "nxd_plain" in med:
        ratio = med["nxd_async"][0] / med["nxd_plain"][0]
        lines.append(
            f"async: total until durable {med['nxd_async'][0]:.2f} s = {ratio:.2f}x the sync save (target <= 1.1)"
        )
    if "dcp_async" in extra:
        dcp_blocked = statistics.median(r["blocked_s"] for r in extra["dcp_async"])
        lines.append(
            f"async: DCP async_save blocks {dcp_blocked:.3f} s and is done after {med['dcp_async'][0]:.2f} s; "
            f"nxd blocked / DCP blocked {a['blocked_s'] / dcp_blocked:.2f} (target < 1)"
        )
    lines.append("async: peak extra host memory: scripts/benchmark_async.py")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="GiB of tensor data (model + optimizer shards)")
    parser.add_argument("--ranks", type=int, default=2, help="processes (DP replicas)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the synthetic layers")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ",".join(SECTIONS)
    )
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    parser.add_argument("--warmup", action="store_true", help="run every section once untimed first")
    parser.add_argument("--json", default=None, help="also write the raw timings here")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    root = tempfile.mkdtemp(prefix="nxd_bench_", dir=args.dir)
    out_path = os.path.join(root, "results.json")
    from harness import rendezvous

    store = rendezvous.serve_store()  # the ranks meet here: port 0 bound by this process, handed to them
    port = int(store.port)
    try:
        mp.spawn(_worker, args=(args, port, root, out_path), nprocs=args.ranks, join=True)
        with open(out_path) as f:
            data = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(data, args)
    print("\ncommand: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
