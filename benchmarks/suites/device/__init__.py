"""Checkpoints of state that lives on a device: what save and load cost against the device's own limits and peers.

Run (one process; the model and its AdamW state on CUDA when torch sees a GPU, else on the XLA CPU device):
    PJRT_DEVICE=CPU ~/.cache/nxd-ckpt/envs/xla/bin/python -m benchmarks device --size-gb 0.4   # 5 reps, ~4 min
    python -m benchmarks device        # GPU machine, from the repo root: 10 GiB, 3 reps, ~6 min
    ... [--device auto|cuda|xla] [--size-gb N] [--reps N] [--steady N] [--first-runs N] [--skip ROWS|none]
        [--sections ROWS] [--json out.json]
The defaults are 10 GiB / 3 reps / 1 steady save per rep on CUDA and 0.4 GiB / 5 reps / 2 on XLA. --sections
names the rows to run (the floors and the steady nxd async xser saves always run), --skip the rows to leave out
(async_plain, async_nosnap, sync, dcp, torch_save, loads, today, check, memory, memory_sync, resume, before_sync,
pressure); by default async_plain, async_nosnap and memory_sync on CUDA and async_nosnap on XLA, to keep the
default runs short.
A missing device is a clear error: --device xla without torch_xla, --device cuda without a GPU.

State: an ``nn.Module`` of transformer blocks (LayerNorm, qkv/proj/fc1/fc2 Linear layers; the hidden size is the
largest of 256..8192 that gives at least 3 blocks: 4096 x 4 blocks, 192 tensors, 9.67 GB at 10 GiB; 1024 x 3,
144 tensors, 0.45 GB at 0.4 GiB) plus ``torch.optim.AdamW`` state (exp_avg, exp_avg_sq): about 1/3 + 2/3 of
--size-gb GiB of fp32, made and changed by real optimizer steps on the device (3 first, 2 before every save).
nxd_ckpt is imported from this tree when run from the repository root (``PYTHONPATH=.``); psutil is not needed.

What one run measures (each line printed when measured, with the seconds since the repetitions began; medians
over --reps interleaved repetitions, the order of the blocks rotated every repetition; the device is synchronised
before every timed operation):
  today        first, in a child process that has the machine to itself: a first async xser save and --today-saves
               steady ones with nxd_ckpt as of --today-ref (``git archive``; default e83f748, the last commit before
               device snapshots, when async saves moved device state to the host inside the call), or of
               --today-src DIR (a directory holding an ``nxd_ckpt`` package); skipped, with the reason, without either.
               Then the same child with this tree's nxd_ckpt: its durable times against today's, both measured in a
               process of their own (the steady rows of this process run between other blocks' writes). Each child
               then makes --training-saves async saves while training goes on, as a real loop does: steps launched
               back to back from the call's return until the save is durable (at least 4): blocked, durable, steps,
               and the training time the save cost in all (the loop's time less as many steps without a save, timed
               just before).
  first async  the process's first ``save_checkpoint(async_save=True, use_xser=True)``, made in this process
               before anything else touches checkpointing or copies the state (after building the model, 3
               training steps and a 1-rank gloo process group on a TCPStore at 127.0.0.1:0, as a training script
               would): time blocked in the call, the SaveReport's fields, time until durable (``report.wait()``),
               extra device memory, and new resident host memory (VmHWM, no sampler thread in the timed call).
               A one-time cost is one sample per process, so --first-runs N (default 2 on XLA, 1 on CUDA) fresh
               child processes, before this process builds its state, make N more first saves, and N first saves
               after ``prepare_async_save(model=, optimizer=)`` (timed too: on XLA state it takes the snapshot once,
               so its graph is compiled before the save), and (row ``resume``) N first saves after a resume:
               ``load_checkpoint`` of a tag one more child saved with ``async_save=True``, then 3 steps; the load
               prepares the next async save (timed: where the one-time cost went), and N with
               NXD_CKPT_PREPARE_ON_RESUME=0 as the control; alternating; the medians are over every sample.
  floors       (a) device -> host copy of every device tensor of the state: CUDA ``copy_(non_blocking=True)``
               into pinned host buffers allocated and touched once, then one synchronize; XLA one bulk
               ``_xla_get_cpu_tensors`` of the already synced state (torch_xla has no copy into a caller's buffer);
               (b) device clone: ``clone()`` of every tensor + synchronize (XLA: one ``_xla_sync_multi``), dropped;
               (c) disk: the bytes of (a) written to one file in the checkpoint directory (64 MiB writes), fsynced.
  nxd async    steady ``save_checkpoint(async_save=True)``: xser (--steady per rep), plain, and xser with
               ``device_snapshot_budget=0`` (the call moves everything to the host itself; only where
               save_checkpoint takes that keyword): time blocked (the call's wall time) and the report's
               ``blocked_s``, ``staging_s``, ``device_snapshot_bytes``, ``device_direct_bytes``, ``device_direct_s``
               (getattr: whichever this nxd_ckpt has), then one training step with the device synced after it
               (what the device's part of the snapshot still costs training: it runs before that step), then durable
               (``wait()`` right after, from the call's start). The floors add one such step with no save in flight.
  nxd sync     ``save_checkpoint(async_save=False, use_xser=True)``: time to return (durable).
  peers        ``torch.distributed.checkpoint.async_save`` (FileSystemWriter, 4 threads, sync_files) with one
               ``DefaultStager`` (CUDA: pinned memory and non-blocking copies; never shared memory; staging inside
               the call): blocked and durable (future done). Where reusing the stager fails (torch 2.11: KeyError
               <class 'type'> on the second save) every later save gets a new stager; where the stager refuses XLA
               tensors (it copies storages) every save gets host copies made by one bulk transfer inside the timed
               call. ``torch.save`` of ``{"model": state_dict, "optim": state_dict}``, fsynced. Failures are
               printed and listed, never fatal.
  loads        cold (page cache dropped before each when root, else marked WARM) into the live model and
               optimizer on the device: nxd ``load_checkpoint(dir, tag, model=, optimizer=)`` (checksums
               verified) of the sync save; ``torch.load(map_location=device)`` + ``load_state_dict`` of both
               (on XLA ``map_location="cpu"``: torch.load cannot restore storages tagged xla:0); ``dcp.load`` into
               the live state dicts + the optimizer's ``load_state_dict``. All three files hold the same state.
  memory       extra device memory of every row (CUDA: peak allocated minus allocated before; on the XLA CPU
               device, device memory is host memory: the report's ``device_snapshot_bytes``), and peak extra host
               memory (core.memory.PeakRSS, sampler on) of an nxd async save until durable, a load of its tag into
               the live model and (memory_sync) a sync save, in untimed runs after the repetitions.
  before_sync  per rep, in turn: a training step synced alone, and the same step with an async xser save called
               after ``optimizer.step()``, before the step's sync (as loops written for NxD do): device time from
               the step's start to the end of the user's sync (XLA: the ExecuteTime metric; CUDA: wall, synced).
  pressure     after the repetitions, once: the device filled to within 10% of its size (CUDA: device memory; the
               XLA CPU device: this host's memory), a new process-wide manager (the budget is decided anew), an
               async xser save with ``device_snapshot_budget="auto"`` and a training step: blocked and durable
               against the steady saves', the budget, what was cloned, whether it fell back.
Every nxd save also counts, in the call, this process's minor page faults (first touches of fresh memory) and
XLA graph compiles: counters the machine's load does not change, which say where a first save's time goes.
Once (rep 0), outside the timing: the state after every load equals the state saved, bit for bit (the live
state is zeroed in place first), and an async save followed at once by two optimizer steps holds the state of
the call. The tables at the end give the medians, the ratios the device-staging targets are stated in (steady
async blocked / pinned copy on CUDA and / device clone on XLA <= 1.5, first / steady async <= 1.5, torch.load
time / nxd load time >= 1.0) and the memory figures; --json writes all of it, every sample included.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks.core.devices import GIB, Device, Training, layout_for, nbytes, pick_device
from benchmarks.core.files import PageCache
from benchmarks.core.ranks import single_rank_group
from benchmarks.core.report import Report
from benchmarks.suites.device.before_sync import BeforeSync
from benchmarks.suites.device.first import first_async, run_first_children
from benchmarks.suites.device.floors import Floors
from benchmarks.suites.device.memory import Memory
from benchmarks.suites.device.nxd_async import NxdAsync
from benchmarks.suites.device.peers import Peers
from benchmarks.suites.device.pressure import Pressure
from benchmarks.suites.device.run import say
from benchmarks.suites.device.saves import accepts, describe_save
from benchmarks.suites.device.summary import build_summary, print_summary
from benchmarks.suites.device.sync import SyncSaves
from benchmarks.suites.device.today import run_today

TITLE = __doc__.splitlines()[0]
TODAY_REF = "e83f748"  # the last commit before device snapshots (async saves moved XLA state in the call)
SECTIONS = {
    "async_plain": "steady nxd async saves, plain",
    "async_nosnap": "steady nxd async xser saves with device_snapshot_budget=0",
    "sync": "nxd sync save (xser)",
    "dcp": "DCP async_save through one DefaultStager, and its load",
    "torch_save": "torch.save + fsync, and its load",
    "loads": "cold loads into the live model and optimizer: nxd, torch.load, dcp.load",
    "today": "today's nxd_ckpt and this tree's, each in a child: first, steady, while training goes on",
    "check": "bit-exact checks of every load and of an async save followed at once by steps (rep 0)",
    "memory": "peak extra host memory of an async save until durable and a load (untimed)",
    "memory_sync": "peak extra host memory of a sync save (untimed)",
    "resume": "first saves in fresh processes after a resume (prepared by the load, and not)",
    "before_sync": "a step with an async save before its sync against the step alone (device time)",
    "pressure": "an async save on a device filled to within 10%",
}
CUDA_SKIP = ("async_plain", "async_nosnap", "memory_sync")  # default --skip: 10 GiB within 6 minutes
XLA_SKIP = ("async_nosnap",)  # 0.4 GiB on 2 cores within about 4 minutes

warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # DCP's FileSystemWriter, every save


class Run(Floors, NxdAsync, BeforeSync, SyncSaves, Peers, Memory, Pressure):
    """The run: every block's methods on one shared state (``RunCore``)."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options (those of scripts/bench_device.py)."""
    add = parser.add_argument
    add("--device", choices=("auto", "cuda", "xla"), default="auto")
    add("--size-gb", type=float, default=None, help="GiB of fp32 state (default: 10 CUDA, 0.4 XLA)")
    add("--reps", type=int, default=None, help="interleaved repetitions (default: 3 CUDA, 5 XLA)")
    add("--steady", type=int, default=None, help="steady nxd async xser saves per repetition (default: 1 CUDA, 2 XLA)")
    add("--training-saves", type=int, default=None, help="saves while training goes on, in each of the today and "
        "this-tree children (default: 1 CUDA, 5 XLA)")  # fmt: skip
    add("--hidden", type=int, default=None, help="hidden size (default: from --size-gb)")
    add("--layers", type=int, default=None, help=argparse.SUPPRESS)
    add("--skip", default=None, help=f"comma-separated rows to leave out, of: {','.join(SECTIONS)} (default: "
        f"{','.join(CUDA_SKIP)} on CUDA, {','.join(XLA_SKIP)} on XLA, to keep the default runs within 6 and 4 minutes; "
        "'none': run every row)")  # fmt: skip
    add("--dir", default=None, help="where checkpoints go (default: a new directory under /tmp)")
    add("--warm", action="store_true", help="do not drop the page cache before loads")
    add("--today-ref", default=TODAY_REF, help="git commit of today's nxd_ckpt (default %(default)s)")
    add("--today-src", default=None, help="a directory holding today's nxd_ckpt package instead")
    add("--today-saves", type=int, default=None, help="steady saves of the today child (default: 1 CUDA, 5 XLA)")
    add("--first-runs", type=int, default=None, help="fresh processes for first saves (default: 2 XLA, 1 CUDA)")


def resolve(args: argparse.Namespace, kind: str) -> None:
    """The device's defaults for what was not given, the rows to run (``args.rows``) and the state's layout."""
    cuda = kind == "cuda"
    if args.sections is not None:
        args.rows = set(args.sections)
    else:
        skip = args.skip if args.skip is not None else ",".join(CUDA_SKIP if cuda else XLA_SKIP)
        skipped = {s for s in skip.split(",") if s and s != "none"}
        if skipped - set(SECTIONS):
            raise SystemExit(f"benchmarks device: unknown rows in --skip: {sorted(skipped - set(SECTIONS))}; choose "
                             f"from {','.join(SECTIONS)}")  # fmt: skip
        args.rows = set(SECTIONS) - skipped
    for name, on_cuda, on_xla in (("size_gb", 10.0, 0.4), ("reps", 3, 5), ("steady", 1, 2), ("today_saves", 1, 5),
                                  ("training_saves", 1, 5), ("first_runs", 1, 2)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_xla)
    args.hidden, layers = layout_for(int(args.size_gb * GIB), args.hidden)
    args.layers = args.layers or layers


def blocks(run: Run) -> list[Callable[[], None]]:
    """The blocks of one repetition, in their order before rotation."""
    import nxd_ckpt

    args = run.args
    out: list[Callable[[], None]] = [run.floors]
    out.append(lambda: run.nxd_async("nxd_async", "nxd async xser", xser=True, count=args.steady))
    if run.on("async_plain"):
        out.append(lambda: run.nxd_async("nxd_async_plain", "nxd async plain", xser=False))
    if run.on("async_nosnap") and accepts(nxd_ckpt.save_checkpoint, "device_snapshot_budget"):
        out.append(lambda: run.nxd_async("nxd_async_nosnap", "nxd async xser, device_snapshot_budget=0", xser=True,
                                         extra={"device_snapshot_budget": 0}))  # fmt: skip
    elif run.on("async_nosnap"):
        say("nxd async with device_snapshot_budget=0: skipped (this nxd_ckpt has no such keyword)")
    out.append(run.saves_and_loads)
    if run.on("before_sync"):
        out.append(run.before_sync)
    return out


def repetitions(run: Run) -> None:
    """Every block --reps times, rotated; then the untimed memory runs and the pressure save."""
    import nxd_ckpt

    order = blocks(run)
    for rep in range(run.args.reps):
        run.rep = rep
        if run.check:
            run.check_async_snapshot()
        k = rep % len(order)
        for block in order[k:] + order[:k]:
            block()
    run.dev.drop_floor_buffers()
    run.phase = "memory"
    if run.on("memory"):
        run.memory()
    run.phase = "pressure"
    if run.on("pressure"):
        run.pressure()
    nxd_ckpt.finalize_checkpoint()
    if run.dcp_stager is not None:
        run.dcp_stager.close()


def meta_of(run: Run, kind: str, tensors: list[Any], load_start: float) -> dict[str, Any]:
    """What the summary's header and the JSON say about the run."""
    import nxd_ckpt

    dev, args, state_bytes = run.dev, run.args, nbytes(tensors)
    return {
        "device": dev.name(), "kind": kind, "versions": dev.versions(),
        "nxd_ckpt": os.path.dirname(nxd_ckpt.__file__), "state_bytes": state_bytes, "state_gb": state_bytes / 1e9,
        "tensors": len(tensors), "hidden": args.hidden, "blocks": args.layers, "reps": args.reps,
        "steady_per_rep": args.steady, "cold": run.cache.cold, "warm_why": run.cache.why,
        "dcp_staging_options": run.dcp_options, "dcp_via_host_copies": run.dcp_via_host,
        "dcp_new_stager_each_save": run.dcp_fresh,
        "torch_load_map_location": str(dev.device) if kind == "cuda" else "cpu",
        "load_start": load_start, "load_end": os.getloadavg()[0], "command": sys.argv,
    }  # fmt: skip


def the_process_first_save(dev: Device, tr: Training, root: str) -> dict[str, Any] | None:
    """This process's first async save, said; None (said, with its traceback) when it failed."""
    try:
        first = first_async(dev, tr, root)
    except Exception:
        say("first async save: FAILED")
        traceback.print_exc()
        return None
    say(f"first async save of the process (xser): {describe_save(first)}")
    return first


def build_state(args: argparse.Namespace, dev: Device, began: float) -> Training:
    """The model and AdamW state on the device, 3 steps trained (on XLA the steady step graph compiled), and the
    process group of a one-process training script; said."""
    tr = Training(dev, args.hidden, args.layers)
    tr.steps(3)
    single_rank_group()
    tensors = tr.tensors()
    state_bytes = nbytes(tensors)
    say(f"state: {state_bytes / 1e9:.3f} GB ({state_bytes / GIB:.3f} GiB) in {len(tensors)} tensors: hidden "
        f"{args.hidden}, {args.layers} blocks, model {nbytes(list(tr.model.parameters())) / 1e9:.3f} GB + AdamW "
        f"(built and trained 3 steps {time.perf_counter() - began:.0f} s into the run)")  # fmt: skip
    return tr


def measure(args: argparse.Namespace, report: Report, kind: str, root: str, cache: PageCache) -> None:
    """Today's children, the first-save children, this process's first save, the repetitions, the summary."""
    today = None
    if "today" in args.rows:  # first: its child process has the machine to itself
        today = run_today(args, kind, root)
        if today is not None:  # and this tree's saves measured the same way, for durable times
            from benchmarks.core.child import REPO

            today["this_tree"] = run_today(args, kind, root, src=REPO)
    samples = run_first_children(args, kind, root)
    dev, began, load_start = Device(kind), time.perf_counter(), report.meta.get("load_start", os.getloadavg()[0])
    tr = build_state(args, dev, began)
    first = the_process_first_save(dev, tr, root)
    run = Run(args, dev, tr, root, cache)
    repetitions(run)
    firsts = [f for f in [first, *(c["first"] for c in samples["plain"])] if f is not None]
    summary = build_summary(run, firsts, samples, today, meta_of(run, kind, tr.tensors(), load_start))
    report.data.update(summary)
    print_summary(report, summary)


def run(args: argparse.Namespace, report: Report) -> int:
    """The device suite: pick the device, resolve the defaults, measure, clean up."""
    import torch.distributed as dist

    import nxd_ckpt

    kind = pick_device(args.device)
    resolve(args, kind)
    dev = Device(kind)
    load_start = os.getloadavg()[0]
    say(f"device: {dev.name()}; {dev.versions()}; nxd_ckpt from {os.path.dirname(nxd_ckpt.__file__)}")
    say(f"load average (1 min) at start: {load_start:.2f}; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="nxd_bench_device_", dir=args.dir) as root:
        cache = PageCache(args.warm)
        loads = "cold (page cache dropped before each)" if cache.cold else f"WARM: {cache.why}"
        say(f"checkpoints in {root}; loads {loads}")
        try:
            measure(args, report, kind, root, cache)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0
