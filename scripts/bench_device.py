"""Checkpoints of state that lives on a device: what save and load cost against the device's own limits and peers.

Run (one process; the model and its AdamW state on CUDA when torch sees a GPU, else on the XLA CPU device):
    PJRT_DEVICE=CPU ~/.cache/nxd-ckpt/envs/xla/bin/python scripts/bench_device.py --size-gb 0.4   # 5 reps, ~4 min
    PYTHONPATH=. python scripts/bench_device.py        # GPU machine, from the repo root: 10 GiB, 3 reps, ~6 min
    ... [--device auto|cuda|xla] [--size-gb N] [--reps N] [--steady N] [--first-runs N] [--skip ROWS|none]
        [--json out.json]
The defaults are 10 GiB / 3 reps / 1 steady save per rep on CUDA and 0.4 GiB / 5 reps / 2 on XLA. --skip leaves
rows out (async_plain, async_nosnap, sync, dcp, torch_save, loads, today, check, memory, memory_sync, resume,
before_sync, pressure); by
default async_plain, async_nosnap and memory_sync on CUDA and async_nosnap on XLA, to keep the default runs short.
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
               memory (benchlib.PeakRSS, sampler on) of an nxd async save until durable, a load of its tag into
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
import contextlib
import dataclasses
import datetime
import inspect
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

GIB = 1 << 30
CHUNK = 64 << 20
TODAY_REF = "e83f748"  # the last commit before device snapshots (async saves moved XLA state in the call)
ROWS = (
    "async_plain",
    "async_nosnap",
    "sync",
    "dcp",
    "torch_save",
    "loads",
    "today",
    "check",
    "memory",
    "memory_sync",
    "resume",
    "before_sync",
    "pressure",
)
CUDA_SKIP = ("async_plain", "async_nosnap", "memory_sync")  # default --skip: 10 GiB within 6 minutes
XLA_SKIP = ("async_nosnap",)  # 0.4 GiB on 2 cores within about 4 minutes
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # DCP's FileSystemWriter, every save


def say(line: str = "") -> None:
    print(line, flush=True)


# ----------------------------------------------------------------------------------------------- device


def pick_device(choice: str) -> str:
    """``cuda`` or ``xla``; a clear error (exit 2) when the asked-for device is not available here."""
    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if choice == "cuda":
        sys.exit(f"bench_device: --device cuda, but this torch ({torch.__version__}) sees no CUDA device")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch_xla  # noqa: F401
    except ImportError as e:
        what = "no CUDA device and " if choice == "auto" else ""
        sys.exit(
            f"bench_device: {what}torch_xla cannot be imported in this environment ({sys.executable}: {e}). "
            "Run it in the XLA environment: PJRT_DEVICE=CPU ~/.cache/nxd-ckpt/envs/xla/bin/python "
            "scripts/bench_device.py (bash scripts/setup_env.sh xla builds it), or on a machine with a GPU."
        )
    return "xla"


class Device:
    """The few device operations the benchmark needs, for CUDA and for XLA."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._pinned: list[torch.Tensor] | None = None
        if kind == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            import torch_xla

            self.xla = torch_xla
            self.device = torch.device(torch_xla.device())

    def name(self) -> str:
        if self.kind == "cuda":
            return f"{torch.cuda.get_device_name(self.device)} (CUDA {torch.version.cuda})"
        import torch_xla.runtime as xr

        return f"XLA {xr.device_type()} device {self.device} (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')})"

    def versions(self) -> str:
        text = f"torch {torch.__version__}"
        if self.kind == "xla":
            text += f", torch_xla {self.xla.__version__}"
        return text

    def sync(self) -> None:
        """Every pending operation on the device done (XLA: pending graphs executed and waited for)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.xla.sync(wait=True)

    def on_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t for t in tensors if t.device.type == self.device.type]

    def host_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Private host copies of ``tensors`` (device ones transferred, host ones cloned), in order."""
        device = self.on_device(tensors)
        if self.kind == "xla":
            moved = iter(self.xla._XLAC._xla_get_cpu_tensors(device))
        else:
            moved = iter([t.detach().to("cpu") for t in device])
        return [next(moved) if t.device.type == self.device.type else t.detach().clone() for t in tensors]

    def reference(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A private copy of ``tensors`` that loads are checked against: on CUDA device clones (compared on the
        device: seconds less per check at 10 GB than host copies), on XLA host copies."""
        if self.kind == "xla":
            return self.host_copies(tensors)
        out = [t.detach().clone() for t in tensors]
        torch.cuda.synchronize(self.device)
        return out

    def readable(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` in a form ``first_difference`` compares with a ``reference``: XLA ones copied to the host."""
        return self.host_copies(tensors) if self.kind == "xla" else tensors

    # floors

    def pinned_copy(self, tensors: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """(seconds, host tensors): floor (a). CUDA buffers are pinned, allocated and touched once, reused."""
        device = self.on_device(tensors)
        if self.kind == "xla":
            self.xla._XLAC._xla_sync_multi(device, devices=[], wait=True)  # already materialised: a no-op
            start = time.perf_counter()
            host = self.xla._XLAC._xla_get_cpu_tensors(device)
            return time.perf_counter() - start, host
        if self._pinned is None or [b.shape for b in self._pinned] != [t.shape for t in device]:
            self._pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device]
            for b in self._pinned:
                b.fill_(0)
        start = time.perf_counter()
        for b, t in zip(self._pinned, device, strict=True):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start, self._pinned

    def clone_sync(self, tensors: list[torch.Tensor]) -> float:
        """Floor (b): a device copy of every device tensor, synchronised; the copies are dropped after."""
        device = self.on_device(tensors)
        start = time.perf_counter()
        clones = [t.clone() for t in device]
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self.xla._XLAC._xla_sync_multi(clones, devices=[], wait=True, sync_xla_data=False)
        elapsed = time.perf_counter() - start
        del clones
        return elapsed

    def device_time_s(self) -> float | None:
        """Seconds of graph execution so far (XLA's ExecuteTime metric); None on CUDA (timed by the wall there)."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data("ExecuteTime")
        return float(data[1]) / 1e9 if data else 0.0

    def fill(self, left_fraction: float) -> tuple[Any, int]:
        """Take the device's memory until ``left_fraction`` of its size is left (CUDA: device memory; the XLA CPU
        device: this host's, its device memory), touched; (the filler to drop, bytes left free)."""
        if self.kind == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            take = max(0, free - int(left_fraction * total))
            filler = torch.empty(take, dtype=torch.uint8, device=self.device).fill_(1)
            torch.cuda.synchronize(self.device)
            return filler, torch.cuda.mem_get_info(self.device)[0]
        with open("/proc/meminfo") as f:
            meminfo = dict(line.split(":", 1) for line in f)
        total, available = (int(meminfo[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
        take = max(0, available - int(left_fraction * total))
        filler = torch.ones(take, dtype=torch.uint8)
        return filler, available - take

    def drop_floor_buffers(self) -> None:
        self._pinned = None

    def compiles(self) -> int:
        """Graphs compiled so far (XLA's CompileTime metric; CUDA compiles nothing here)."""
        if self.kind != "xla":
            return 0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    # memory

    def mem_start(self) -> int | None:
        if self.kind != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def mem_peak(self, base: int | None) -> int | None:
        """Peak extra device bytes since ``mem_start`` (None where the device has no allocator figures)."""
        if base is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - base


# ----------------------------------------------------------------------------------------------- state


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(attention @ v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Model(torch.nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layout_for(total_bytes: int, hidden: int | None) -> tuple[int, int]:
    """(hidden, blocks) so that model + 2 AdamW moments come near ``total_bytes`` of fp32."""

    def per_block(h: int) -> int:
        return (12 * h * h + 13 * h) * 4

    model_bytes = total_bytes / 3
    if hidden is None:
        hidden = 256
        for h in (512, 1024, 2048, 4096, 8192):
            if round(model_bytes / per_block(h)) >= 3:
                hidden = h
    return hidden, max(1, round(model_bytes / per_block(hidden)))


class Training:
    """The model, its AdamW optimizer and a fixed input on the device; ``steps`` runs real optimizer steps."""

    def __init__(self, dev: Device, hidden: int, layers: int, seed: int = 0) -> None:
        self.dev = dev
        torch.manual_seed(seed)
        if dev.kind == "cuda":
            with torch.device(dev.device):
                self.model = Model(hidden, layers)
        else:
            self.model = Model(hidden, layers).to(dev.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(seed)).to(dev.device)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.launch_step()
        self.dev.sync()

    def launch_step(self) -> None:
        """One optimizer step, launched and not waited for (XLA: its ``mark_step``), as a training loop runs it."""
        self.trace_step()
        if self.dev.kind == "xla":
            self.dev.xla.sync()

    def trace_step(self) -> None:
        """One optimizer step up to its sync, not included (XLA: the step is a pending graph afterwards)."""
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, in a fixed order: parameters, then each one's AdamW state."""
        params = list(self.model.parameters())
        out = [p.detach() for p in params]
        for p in params:
            state = self.opt.state[p]
            out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return out

    def scribble(self) -> None:
        """Zero every tensor of the state in place (before a checked load: the load must bring every byte back).
        Parameters are written as themselves, as an optimizer does, not through ``detach()`` aliases."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
                for t in self.opt.state[p].values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()
        self.dev.sync()

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def host_state(dev: Device, tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples) with its device tensors replaced by host copies (one bulk transfer on XLA)."""
    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, list | tuple):
            for v in x:
                collect(v)

    collect(tree)
    copies = {id(t): c for t, c in zip(found, dev.host_copies(found), strict=True)}

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copies[id(x)] if x.device.type != "cpu" else x
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(rebuild(v) for v in x)
        return x

    return rebuild(tree)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def first_difference(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> str | None:
    if len(expected) != len(actual):
        return f"{len(actual)} tensors instead of {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b.to(a.device)):
            return f"tensor {i} ({tuple(a.shape)}, {a.dtype}) differs"
    return None


# ----------------------------------------------------------------------------------------------- files


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsynced(path: str, tensors: list[torch.Tensor]) -> None:
    """Floor (c): the tensors' bytes written to one file in 64 MiB pieces, then fsync (file and directory)."""
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for offset in range(0, len(view), CHUNK):
                piece = view[offset : offset + CHUNK]
                while piece:
                    piece = piece[f.write(piece) :]
        os.fsync(f.fileno())
    fsync_path(os.path.dirname(path))


def torch_save_fsynced(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(os.path.dirname(path))


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class PageCache:
    """Drops the page cache before cold loads when this process may (root, writable drop_caches)."""

    def __init__(self, warm: bool) -> None:
        self.cold, self.why = False, "--warm given"
        if not warm:
            self.cold, self.why = self._drop()

    @staticmethod
    def _drop() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root"
        done = subprocess.run(
            ["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], capture_output=True, text=True, check=False
        )
        return (True, "") if done.returncode == 0 else (False, done.stderr.strip() or f"rc {done.returncode}")

    def drop(self) -> None:
        if self.cold:
            self.cold, self.why = self._drop()
            if not self.cold:
                say(f"page cache: could not drop it any more ({self.why}); later loads are WARM")


# ----------------------------------------------------------------------------------------------- process group


def init_process_group() -> None:
    """A 1-rank gloo group on a store this process serves on 127.0.0.1 (port 0: the kernel picks it)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))


# ----------------------------------------------------------------------------------------------- nxd saves

REPORT_FIELDS = (
    "blocked_s",
    "waited_s",
    "staging_s",
    "staging_allocated_bytes",
    "device_snapshot_bytes",
    "device_direct_bytes",
    "device_direct_s",
    "device_budget_bytes",
    "budget_wait_s",
    "budget_peak_bytes",
    "budget_overdrawn_bytes",
    "bytes_written",
    "write_s",
    "total_s",
)


def minor_faults() -> int:
    """This process's minor page faults so far: first touches of fresh memory (counted, not timed: load-proof)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def report_fields(report: Any) -> dict[str, Any]:
    """The SaveReport's figures this benchmark knows about, those this nxd_ckpt has (getattr)."""
    return {k: getattr(report, k) for k in REPORT_FIELDS if hasattr(report, k)}


def accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def nxd_save(
    dev: Device, path: str, tag: str, tr: Training, *, xser: bool, async_save: bool, extra: dict | None = None
) -> dict[str, Any]:
    """One timed nxd save of ``tr``'s state: call wall time, report fields, durable time, device peak; after an
    async call, one training step (device synced) before the wait, timed."""
    import nxd_ckpt as nxd

    base = dev.mem_start()
    faults, compiles = minor_faults(), dev.compiles()
    start = time.perf_counter()
    report = nxd.save_checkpoint(
        path, tag, model=tr.model, optimizer=tr.opt, use_xser=xser, async_save=async_save, **(extra or {})
    )
    call_s = time.perf_counter() - start
    counters = {"call_minflt": minor_faults() - faults, "call_compiles": dev.compiles() - compiles}
    peak_call = dev.mem_peak(base)
    if async_save:  # the training thread's next step, device synced: what the snapshot still costs training
        step_start = time.perf_counter()
        tr.steps(1)
        counters["step_after_s"] = time.perf_counter() - step_start
    report.wait()
    durable_s = time.perf_counter() - start
    out = {"call_s": call_s, "durable_s": durable_s, "dev_peak_call": peak_call, "dev_peak": dev.mem_peak(base)}
    out |= counters
    return out | {"report": report_fields(report)}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= 1e8:
        return f"{n / 1e9:.3f} GB"
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e5 else f"{n / 1e3:.1f} kB"


def describe_save(figures: dict[str, Any]) -> str:
    r = figures.get("report", {})
    parts = [f"blocked {figures['call_s']:.3f} s"]
    details = [f"report blocked_s {r['blocked_s']:.3f} s"] if "blocked_s" in r else []
    details += [f"staging {r['staging_s']:.3f} s"] if "staging_s" in r else []
    if r.get("waited_s", 0) >= 0.001:
        details.append(f"waited {r['waited_s']:.3f} s")
    for key in ("device_snapshot_bytes", "device_direct_bytes"):
        if key in r:
            details.append(f"{key.removesuffix('_bytes').replace('_', ' ')} {fmt_bytes(r[key])}")
    if "device_direct_s" in r:
        details.append(f"device direct {r['device_direct_s']:.3f} s")
    if r.get("staging_allocated_bytes"):
        details.append(f"host staging allocated {fmt_bytes(r['staging_allocated_bytes'])}")
    if r.get("budget_peak_bytes"):  # under a host memory budget (NXD_CKPT_HOST_MEMORY_BUDGET)
        details.append(
            f"host budget: waited {r.get('budget_wait_s', 0):.3f} s, copies held at most "
            f"{fmt_bytes(r['budget_peak_bytes'])}, overdrawn {fmt_bytes(r.get('budget_overdrawn_bytes', 0))}"
        )
    parts[0] += f" ({', '.join(details)})" if details else ""
    if "call_minflt" in figures:
        parts.append(f"{figures['call_minflt']} page faults and {figures['call_compiles']} graph compiles in the call")
    if "step_after_s" in figures:
        parts.append(f"next training step (synced) {figures['step_after_s']:.3f} s")
    parts.append(f"durable after {figures['durable_s']:.3f} s")
    if figures.get("dev_peak") is not None:
        parts.append(
            f"extra device memory {fmt_bytes(figures['dev_peak_call'])} in the call, "
            f"{fmt_bytes(figures['dev_peak'])} until durable"
        )
    if "first_host_rss" in figures:
        parts.append(f"extra host memory (resident) {fmt_bytes(figures['first_host_rss'])}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    dev: Device
    tr: Training
    root: str
    cache: PageCache
    results: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    checks: dict[str, str] = dataclasses.field(default_factory=dict)
    rep: int = 0
    phase: str = ""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    dcp_stager: Any = None
    dcp_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    dcp_via_host: str = ""
    """Why DCP saves get host copies of the state (its stager refused the device tensors), or ""."""
    dcp_fresh: str = ""
    """Why every DCP save gets a new DefaultStager (reusing one failed), or ""."""

    def on(self, row: str) -> bool:
        return row not in self.args.skip

    def where(self) -> str:
        return f"[{self.phase or f'rep {self.rep}'}, {time.perf_counter() - self.started:.0f} s]"

    def add(self, name: str, value: Any, line: str) -> None:
        self.results.setdefault(name, []).append(value)
        say(f"{self.where()} {line}")

    def failed(self, name: str, error: BaseException, loud: bool = False) -> None:
        text = f"{type(error).__name__}: {error}".strip()
        self.errors.setdefault(name, text)
        say(f"{self.where()} {name}: FAILED: {text.splitlines()[0]}")
        if loud:
            traceback.print_exc()
            sys.stderr.flush()

    @property
    def check(self) -> bool:
        return self.rep == 0 and self.on("check")

    # floors

    def floors(self) -> None:
        tensors = self.tr.tensors()
        device_bytes = nbytes(self.dev.on_device(tensors))
        copy_s, host = self.dev.pinned_copy(tensors)
        what = "pinned d2h copy" if self.dev.kind == "cuda" else "bulk _xla_get_cpu_tensors"
        self.add("floor_copy_s", copy_s, f"floor {what}: {copy_s:.3f} s ({device_bytes / copy_s / 1e9:.2f} GB/s)")
        clone_s = self.dev.clone_sync(tensors)
        self.add("floor_clone_s", clone_s, f"floor device clone + sync: {clone_s:.3f} s")
        start = time.perf_counter()
        self.tr.steps(1)
        step_s = time.perf_counter() - start
        self.add("floor_step_s", step_s, f"one training step (synced), no save in flight: {step_s:.3f} s")
        path = os.path.join(self.root, "floor.bin")
        start = time.perf_counter()
        write_fsynced(path, host)
        disk_s = time.perf_counter() - start
        remove(path)
        del host
        self.add(
            "floor_disk_s", disk_s, f"floor disk write + fsync: {disk_s:.3f} s ({device_bytes / disk_s / 1e9:.2f} GB/s)"
        )

    # nxd async

    def nxd_async(self, name: str, label: str, *, xser: bool, extra: dict | None = None, count: int = 1) -> None:
        path = os.path.join(self.root, name)
        for i in range(count):
            self.tr.steps(2)
            tag = f"r{self.rep}_{i}"
            try:
                figures = nxd_save(self.dev, path, tag, self.tr, xser=xser, async_save=True, extra=extra)
            except Exception as e:
                self.failed(name, e, loud=True)
                return
            finally:
                remove(os.path.join(path, tag))
            self.add(name, figures, f"{label} #{i + 1}: {describe_save(figures)}")

    def before_sync(self) -> None:
        """A save called after the optimizer step, before the step's sync (as loops written for NxD do): device time
        from the step's start to the end of the user's sync (XLA: executions, CUDA: wall, synchronised), against the
        same step without a save, in turn."""
        import nxd_ckpt as nxd

        path = os.path.join(self.root, "before_sync")
        for name in ("step_alone", "step_save_before_sync"):
            self.dev.sync()
            device0, wall0 = self.dev.device_time_s(), time.perf_counter()
            self.tr.trace_step()
            report = None
            if name == "step_save_before_sync":
                try:
                    report = nxd.save_checkpoint(
                        path, f"r{self.rep}", model=self.tr.model, optimizer=self.tr.opt, use_xser=True, async_save=True
                    )
                except Exception as e:
                    self.failed(name, e, loud=True)
                    return
            if self.dev.kind == "xla":
                self.dev.xla.sync()  # the user's sync
            self.dev.sync()
            device1, wall = self.dev.device_time_s(), time.perf_counter() - wall0
            spent = device1 - device0 if device1 is not None and device0 is not None else wall
            ran = f", ran the pending step: {getattr(report, 'ran_pending_step', '?')}" if report is not None else ""
            self.add(name, spent, f"{name.replace('_', ' ')}: device time {spent:.3f} s (wall {wall:.3f} s){ran}")
            if report is not None:
                report.wait()
                remove(os.path.join(path, f"r{self.rep}"))

    def check_async_snapshot(self) -> None:
        """An async save followed at once by optimizer steps (which change the state in place while the save is
        written): the tag must hold the state of the call."""
        import nxd_ckpt as nxd

        path, tag = os.path.join(self.root, "check_async"), "snapshot"
        self.tr.steps(2)
        expected = self.dev.reference(self.tr.tensors())
        try:
            report = nxd.save_checkpoint(
                path, tag, model=self.tr.model, optimizer=self.tr.opt, use_xser=True, async_save=True
            )
            self.tr.steps(2)
            report.wait()
            model, optim = {}, {}
            nxd.load_checkpoint(path, tag, model=model, optimizer=optim)
        except Exception as e:
            self.failed("check_async", e, loud=True)
            return
        finally:
            remove(path)
        names = list(self.tr.model.state_dict())
        loaded = [model[k] for k in names]
        for i in range(len(names)):
            state = optim["state"][i]
            loaded += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        diff = first_difference(expected, loaded)
        self.checks["async save holds the state of the call (steps right after it)"] = diff or "equal"
        outcome = "OK, bit-exact" if not diff else f"DIFFERS: {diff}"
        say(f"{self.where()} check: async save + immediate steps: {outcome}")

    # the saves that are loaded back (all taken of one state)

    def saves_and_loads(self) -> None:
        self.tr.steps(2)
        expected = self.dev.reference(self.tr.tensors()) if self.check else None
        nxd_path, tag = os.path.join(self.root, "nxd_sync"), f"r{self.rep}"
        torch_path = os.path.join(self.root, "torch_save.pt")
        dcp_path = os.path.join(self.root, f"dcp_r{self.rep}")
        saved: dict[str, bool] = {}
        savers = []
        if self.on("sync") or self.on("loads"):
            savers.append(("nxd_sync", lambda: self.save_nxd_sync(nxd_path, tag)))
        if self.on("torch_save"):
            savers.append(("torch_save", lambda: self.save_torch(torch_path)))
        if self.on("dcp"):
            savers.append(("dcp_async", lambda: self.save_dcp(dcp_path)))
        k = self.rep % max(1, len(savers))
        for name, fn in savers[k:] + savers[:k]:
            saved[name] = fn()
        if self.on("loads"):
            loaders = []
            if saved.get("nxd_sync"):
                loaders.append(("load_nxd", lambda: self.load_nxd(nxd_path, tag)))
            if saved.get("torch_save"):
                loaders.append(("load_torch", lambda: self.load_torch(torch_path)))
            if saved.get("dcp_async"):
                loaders.append(("load_dcp", lambda: self.load_dcp(dcp_path)))
            k = self.rep % max(1, len(loaders))
            for name, fn in loaders[k:] + loaders[:k]:
                self.timed_load(name, fn, expected)
        for path in (nxd_path, torch_path, dcp_path):
            remove(path)

    def save_nxd_sync(self, path: str, tag: str) -> bool:
        try:
            figures = nxd_save(self.dev, path, tag, self.tr, xser=True, async_save=False)
        except Exception as e:
            self.failed("nxd_sync", e, loud=True)
            return False
        peak = f", extra device memory {fmt_bytes(figures['dev_peak'])}" if figures["dev_peak"] is not None else ""
        self.add("nxd_sync", figures, f"nxd sync save (xser): {figures['call_s']:.3f} s to durable{peak}")
        return True

    def save_torch(self, path: str) -> bool:
        base = self.dev.mem_start()
        try:
            start = time.perf_counter()
            torch_save_fsynced(self.tr.state_dicts(), path)
            elapsed = time.perf_counter() - start
        except Exception as e:
            self.failed("torch_save", e)
            return False
        peak = self.dev.mem_peak(base)
        extra = f", extra device memory {fmt_bytes(peak)}" if peak is not None else ""
        self.add("torch_save", {"s": elapsed, "dev_peak": peak}, f"torch.save + fsync: {elapsed:.3f} s{extra}")
        return True

    def dcp_stage(self) -> Any:
        """One DefaultStager for every DCP save (its cached pinned storages are reused), or None when this torch
        has none (then async_save stages with its own default)."""
        if self.dcp_stager is None and not self.dcp_options.get("unavailable"):
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError as e:
                self.dcp_options["unavailable"] = str(e)
                return None
            cuda = self.dev.kind == "cuda"
            options: dict[str, bool] = {}
            for f in dataclasses.fields(StagingOptions):
                if "pinned" in f.name or "non_blocking" in f.name:
                    options[f.name] = cuda
                elif "shared" in f.name or "async_staging" in f.name:
                    options[f.name] = False
            self.dcp_options = options
            self.dcp_stager = DefaultStager(StagingOptions(**options))
            if not self.dcp_fresh or not self.results.get("dcp_async"):
                say(f"dcp: DefaultStager(StagingOptions({', '.join(f'{k}={v}' for k, v in options.items())}))")
        return self.dcp_stager

    def save_dcp(self, path: str) -> bool:
        import torch.distributed.checkpoint as dcp

        if self.dcp_fresh and self.dcp_stager is not None:  # untimed: unpinning the previous stager's buffers
            self.dcp_stager.close()
            self.dcp_stager = None
        base = self.dev.mem_start()
        stager = None
        try:
            stager = self.dcp_stage()
            writer = dcp.FileSystemWriter(path, thread_count=4, sync_files=True)
            start = time.perf_counter()
            kwargs = {"async_stager": stager} if stager is not None else {}
            state = self.tr.state_dicts()
            if self.dcp_via_host:
                state = host_state(self.dev, state)
            response = dcp.async_save(state, storage_writer=writer, **kwargs)
            blocked = time.perf_counter() - start
            peak_call = self.dev.mem_peak(base)
            upload = getattr(response, "upload_completion", response)
            staging = getattr(response, "staging_completion", None)
            if staging is not None:  # staging in a thread: training may go on only once it is done
                staging.result()
                blocked = time.perf_counter() - start
            upload.result()
            durable = time.perf_counter() - start
        except Exception as e:
            if stager is not None and not self.dcp_fresh and self.results.get("dcp_async"):
                # torch 2.11: the second async_save through one DefaultStager raised KeyError: <class 'type'>
                self.dcp_fresh = f"{type(e).__name__}: {e}".splitlines()[0]
                say(
                    f"{self.where()} dcp async_save through the DefaultStager used before failed ({self.dcp_fresh}); "
                    "from now on every DCP save gets a new DefaultStager (its pinned buffers allocated in the call)"
                )
                remove(path)
                return self.save_dcp(path)
            if self.dev.kind == "xla" and not self.dcp_via_host:
                self.dcp_via_host = f"{type(e).__name__}: {e}".splitlines()[0]
                say(
                    f"{self.where()} dcp async_save of the XLA state failed ({self.dcp_via_host}); from now on it "
                    "gets host copies (one bulk transfer, timed as part of the call), as a DCP user on XLA would do"
                )
                remove(path)
                return self.save_dcp(path)
            self.failed("dcp_async", e)
            return False
        figures = {
            "call_s": blocked,
            "durable_s": durable,
            "dev_peak_call": peak_call,
            "dev_peak": self.dev.mem_peak(base),
        }
        how = " (of host copies)" if self.dcp_via_host else " (new DefaultStager)" if self.dcp_fresh else ""
        self.add("dcp_async", figures, f"dcp async_save{how}: {describe_save(figures)}")
        return True

    def timed_load(self, name: str, fn: Callable[[], None], expected: list[torch.Tensor] | None) -> None:
        if expected is not None:
            self.tr.scribble()
        self.cache.drop()
        base = self.dev.mem_start()
        try:
            start = time.perf_counter()
            fn()
            self.dev.sync()
            elapsed = time.perf_counter() - start
        except Exception as e:
            self.failed(name, e, loud=name == "load_nxd")
            if expected is not None:  # put the state back for the next rows
                self.restore(expected)
            return
        peak = self.dev.mem_peak(base)
        state = "cold" if self.cache.cold else "WARM"
        extra = f", extra device memory {fmt_bytes(peak)}" if peak is not None else ""
        self.add(name, {"s": elapsed, "dev_peak": peak}, f"{name} ({state}): {elapsed:.3f} s{extra}")
        if expected is not None:
            diff = first_difference(expected, self.dev.readable(self.tr.tensors()))
            self.checks[f"{name} restores the saved state"] = diff or "equal"
            say(f"{self.where()} check: {name}: {'OK, bit-exact' if not diff else 'DIFFERS: ' + diff}")
            if diff:
                self.restore(expected)

    def restore(self, expected: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, e in zip(self.tr.tensors(), expected, strict=False):
                t.copy_(e)
        self.dev.sync()

    def load_nxd(self, path: str, tag: str) -> None:
        import nxd_ckpt as nxd

        nxd.load_checkpoint(path, tag, model=self.tr.model, optimizer=self.tr.opt)

    def load_torch(self, path: str) -> None:
        # torch.load cannot place storages on an XLA device ("don't know how to restore data location of
        # torch.storage.UntypedStorage (tagged with xla:0)"): there it loads to the CPU and load_state_dict moves it.
        location = self.dev.device if self.dev.kind == "cuda" else "cpu"
        state = torch.load(path, map_location=location, weights_only=True)
        self.tr.model.load_state_dict(state["model"])
        self.tr.opt.load_state_dict(state["optim"])
        del state

    def load_dcp(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = self.tr.state_dicts()
        dcp.load(state, checkpoint_id=path)
        self.tr.opt.load_state_dict(state["optim"])

    # memory (untimed)

    def memory(self) -> None:
        """Peak extra host memory of the nxd paths (sampler on; untimed runs) and their device figures: an async
        save until durable, a load of its tag into the live model, and a sync save (not on CUDA by default, where a
        sync save stages nothing on the host: 0.6 MB at 1 and 10 GB; ``--skip`` without ``memory_sync`` adds it)."""
        from benchlib import PeakRSS

        path = os.path.join(self.root, "memory")
        runs = [("mem_async", "async save until durable", True)]
        if self.on("memory_sync"):
            runs.append(("mem_sync", "sync save", False))
        for name, label, async_save in runs:
            self.tr.steps(2)
            peak = PeakRSS()
            try:
                with peak:
                    figures = nxd_save(self.dev, path, name, self.tr, xser=True, async_save=async_save)
            except Exception as e:
                self.failed(name, e, loud=True)
                continue
            figures |= {"host_extra": peak.extra, "host_extra_rss": peak.extra_rss}
            self.add(
                name,
                figures,
                f"memory, nxd {label}: extra host memory {fmt_bytes(peak.extra)} (resident "
                f"{fmt_bytes(peak.extra_rss)}), {describe_save(figures)}",
            )
            if async_save and self.on("loads"):
                self.memory_load(path, name)
        remove(path)

    def pressure(self) -> None:
        """An async save with ``device_snapshot_budget="auto"`` on a device filled to within 10% of its size, then a
        training step (it must run): blocked time against the steady saves', what the snapshot took, and whether it
        fell back to the direct transfer. The process-wide manager is replaced first, so the budget is decided anew
        under the pressure (a manager keeps its budget from save to save)."""
        from nxd_ckpt.api import reset_manager

        path = os.path.join(self.root, "pressure")
        reset_manager()
        filler, left = self.dev.fill(0.10)
        try:
            self.tr.steps(2)
            figures = nxd_save(self.dev, path, "pressure", self.tr, xser=True, async_save=True)
            self.tr.steps(1)
        except Exception as e:
            self.failed("pressure", e, loud=True)
            return
        finally:
            del filler
            reset_manager()
            remove(path)
        fields = figures["report"]
        fallback = fields.get("device_snapshot_fallback")
        self.add(
            "pressure",
            figures,
            f"memory pressure ({fmt_bytes(left)} left free): {describe_save(figures)}; snapshot "
            f"{fmt_bytes(fields.get('device_snapshot_bytes'))}, direct {fmt_bytes(fields.get('device_direct_bytes'))}, "
            f"budget {fmt_bytes(fields.get('device_budget_bytes'))}, fallback: {fallback}",
        )

    def memory_load(self, path: str, tag: str) -> None:
        from benchlib import PeakRSS

        peak = PeakRSS()
        base = self.dev.mem_start()
        try:
            with peak:
                self.load_nxd(path, tag)
                self.dev.sync()
        except Exception as e:
            self.failed("mem_load", e, loud=True)
            return
        dev_peak = self.dev.mem_peak(base)
        self.add(
            "mem_load",
            {"host_extra": peak.extra, "host_extra_rss": peak.extra_rss, "dev_peak": dev_peak},
            f"memory, nxd load into the live model (warm): extra host memory {fmt_bytes(peak.extra)} "
            f"(resident {fmt_bytes(peak.extra_rss)}), extra device memory {fmt_bytes(dev_peak)}",
        )


# ----------------------------------------------------------------------------------------------- first and today


def first_async(dev: Device, tr: Training, root: str) -> dict[str, Any]:
    """The process's first async save (nothing touched checkpointing before), with its resident-memory growth."""
    from benchlib import PeakRSS

    import nxd_ckpt as nxd

    nxd.save_checkpoint  # noqa: B018 - resolved (imported) before the timing, as a training script does at its start
    path = os.path.join(root, "first")
    peak = PeakRSS(sample=False)
    with peak:
        figures = nxd_save(dev, path, "first", tr, xser=True, async_save=True)
    figures |= {"first_host_rss": peak.extra_rss}
    remove(path)
    return figures


def first_child(args: argparse.Namespace) -> int:
    """In a fresh child: the state, 3 steps, the process group, then the process's first async save; its figures
    go to the --first-child file. Before the save, --first-prepare: ``prepare_async_save``; --first-resume on|off:
    instead of the steps, ``load_checkpoint`` of the async-saved tag in --resume-dir (which prepares the next
    async save; ``off``: with NXD_CKPT_PREPARE_ON_RESUME=0), then the 3 steps; --write-resume-tag: only that tag's
    async save (into --resume-dir), no figures."""
    import nxd_ckpt as nxd

    dev = Device(pick_device(args.device))
    tr = Training(dev, args.hidden, args.layers)
    out: dict[str, Any] = {}
    if args.first_resume:
        init_process_group()
        if args.first_resume == "off":
            os.environ["NXD_CKPT_PREPARE_ON_RESUME"] = "0"
        compiles, start = dev.compiles(), time.perf_counter()
        nxd.load_checkpoint(args.resume_dir, model=tr.model, optimizer=tr.opt)
        out["load_s"] = time.perf_counter() - start
        out["load_compiles"] = dev.compiles() - compiles
        tr.steps(3)
    else:
        tr.steps(3)
        init_process_group()
    if args.write_resume_tag:
        nxd.save_checkpoint(args.resume_dir, "resume", model=tr.model, optimizer=tr.opt, use_xser=True, async_save=True)
        nxd.finalize_checkpoint()
        return 0
    if args.first_prepare:
        compiles, start = dev.compiles(), time.perf_counter()
        nxd.prepare_async_save(model=tr.model, optimizer=tr.opt, use_xser=True)
        out["prepare_s"] = time.perf_counter() - start
        out["prepare_compiles"] = dev.compiles() - compiles
    out["first"] = first_async(dev, tr, args.dir)
    nxd.finalize_checkpoint()
    with open(args.first_child, "w") as f:
        json.dump(out, f)
    return 0


FIRST_KINDS = {
    "plain": ([], ""),
    "prepared": (["--first-prepare"], "after prepare_async_save"),
    "resumed": (["--first-resume", "on"], "after a resume of an async-saved tag"),
    "resumed_off": (["--first-resume", "off"], "after a resume with NXD_CKPT_PREPARE_ON_RESUME=0"),
}


def run_first_children(args: argparse.Namespace, kind: str, root: str) -> dict[str, list[dict]]:
    """--first-runs fresh processes of each kind of first save (``FIRST_KINDS``), alternating; the resumed ones
    load a tag one more child saved asynchronously first (with this nxd_ckpt, where it can resume)."""
    common = [sys.executable, os.path.abspath(__file__), "--device", kind, "--hidden", str(args.hidden)]
    common += ["--layers", str(args.layers)]
    kinds = list(FIRST_KINDS)
    resume_dir = os.path.join(root, "resume_tag")
    import nxd_ckpt

    if "resume" in args.skip or not hasattr(nxd_ckpt, "prepare_async_save"):
        kinds = ["plain", "prepared"]
    else:
        written = subprocess.run(
            [*common, "--dir", root, "--first-child", "-", "--write-resume-tag", "--resume-dir", resume_dir],
            check=False,
        )
        if written.returncode != 0:
            say(f"the tag the resumed first saves load: FAILED (rc {written.returncode}); no resumed first saves")
            kinds = ["plain", "prepared"]
    samples: dict[str, list[dict]] = {k: [] for k in FIRST_KINDS}
    for i in range(args.first_runs):
        for name in kinds:
            flags, what = FIRST_KINDS[name]
            out, work = os.path.join(root, f"first_{i}_{name}.json"), os.path.join(root, f"first_work_{i}")
            os.makedirs(work)
            cmd = [*common, "--dir", work, "--first-child", out, "--resume-dir", resume_dir, *flags]
            done = subprocess.run(cmd, check=False)
            shutil.rmtree(work, ignore_errors=True)
            if done.returncode != 0 or not os.path.exists(out):
                say(f"first save in a fresh process {what}: FAILED (rc {done.returncode})")
                continue
            with open(out) as f:
                figures = json.load(f)
            samples[name].append(figures)
            if "prepare_s" in figures:
                what += f" ({figures['prepare_s']:.3f} s, {figures['prepare_compiles']} compiles)"
            if "load_s" in figures:
                what += f" (load {figures['load_s']:.3f} s, {figures['load_compiles']} compiles)"
            say(f"[fresh process {i + 1}] first async save {what} (xser): {describe_save(figures['first'])}")
    shutil.rmtree(resume_dir, ignore_errors=True)
    return samples


def today_child(args: argparse.Namespace) -> int:
    """In the child: the same state, first + --reps steady async xser saves with the nxd_ckpt found first."""
    import nxd_ckpt

    if not os.path.abspath(nxd_ckpt.__file__).startswith(os.path.abspath(args.today_child_src)):
        sys.exit(f"bench_device: the child imported nxd_ckpt from {nxd_ckpt.__file__}, not {args.today_child_src}")
    dev = Device(pick_device(args.device))
    tr = Training(dev, args.hidden, args.layers)
    tr.steps(3)
    init_process_group()
    out: dict[str, Any] = {"nxd_ckpt": os.path.dirname(nxd_ckpt.__file__)}
    out["first"] = first_async(dev, tr, args.dir)
    who = "today" if os.path.abspath(args.today_child_src) != REPO else "this tree"
    say(f"[{who}] first async save: {describe_save(out['first'])}")
    out["steady"] = []
    path = os.path.join(args.dir, "today")
    for i in range(args.reps):
        tr.steps(2)
        figures = nxd_save(dev, path, f"s{i}", tr, xser=True, async_save=True)
        remove(os.path.join(path, f"s{i}"))
        out["steady"].append(figures)
        say(f"[{who}] steady async save #{i + 1}: {describe_save(figures)}")
    out["training"] = []
    for i in range(args.training_saves):
        figures = save_while_training(dev, tr, os.path.join(args.dir, "training"), f"t{i}")
        out["training"].append(figures)
        say(
            f"[{who}] async save while training goes on #{i + 1}: blocked {figures['call_s']:.3f} s, durable "
            f"{figures['durable_s']:.2f} s, {figures['steps']} steps in {figures['total_s']:.2f} s against "
            f"{figures['step_alone_s']:.3f} s a step alone: training lost {figures['lost_s']:.2f} s"
        )
    nxd_ckpt.finalize_checkpoint()
    with open(args.today_child, "w") as f:
        json.dump(out, f)
    return 0


TRAINING_MIN_STEPS = 4


def save_while_training(dev: Device, tr: Training, path: str, tag: str) -> dict[str, Any]:
    """An async xser save in a loop that goes on training, as a real one does: steps launched back to back from the
    call's return until the save is durable (at least ``TRAINING_MIN_STEPS``), then the device synced. Times the
    call, durable (``report.wait()`` on a thread), and the loop against the same number of steps without a save,
    timed just before: what the save cost training in all (blocked + slower steps)."""
    import threading

    import nxd_ckpt as nxd

    start = time.perf_counter()
    for _ in range(TRAINING_MIN_STEPS):
        tr.launch_step()
    dev.sync()
    step_alone_s = (time.perf_counter() - start) / TRAINING_MIN_STEPS
    durable = threading.Event()
    stamps: dict[str, Any] = {}

    def wait_durable(report: Any) -> None:
        try:
            report.wait()
        except BaseException as e:
            stamps["error"] = repr(e)
        stamps["durable"] = time.perf_counter()
        durable.set()

    start = time.perf_counter()
    report = nxd.save_checkpoint(path, tag, model=tr.model, optimizer=tr.opt, use_xser=True, async_save=True)
    call_s = time.perf_counter() - start
    threading.Thread(target=wait_durable, args=(report,), daemon=True).start()
    steps = 0
    while steps < TRAINING_MIN_STEPS or (not durable.is_set() and steps < 500):
        tr.launch_step()
        steps += 1
    dev.sync()
    total_s = time.perf_counter() - start
    if not durable.wait(600):
        raise RuntimeError(f"the save {tag} was not durable 600 s after its training steps")
    if "error" in stamps:
        raise RuntimeError(f"the save {tag} failed: {stamps['error']}")
    remove(os.path.join(path, tag))
    return {
        "call_s": call_s,
        "durable_s": stamps["durable"] - start,
        "steps": steps,
        "total_s": total_s,
        "step_alone_s": step_alone_s,
        "lost_s": total_s - steps * step_alone_s,
    }


def run_today(args: argparse.Namespace, kind: str, root: str, src: str | None = None) -> dict[str, Any] | None:
    """The saves of today's nxd_ckpt (--today-src, or --today-ref extracted with git archive) in a child process;
    ``src``: another tree's nxd_ckpt (this one's, for durable times measured the same way as today's)."""
    name = "today" if src is None else "this tree"
    src = src or args.today_src
    if src is None:
        src = os.path.join(root, "today_src")
        os.makedirs(src)
        archive = subprocess.run(
            ["git", "-C", REPO, "archive", "--format=tar", args.today_ref, "nxd_ckpt"], capture_output=True, check=False
        )
        if archive.returncode != 0:
            say(
                f"today: skipped: git archive {args.today_ref} failed ({archive.stderr.decode().strip()[:200]}); "
                "--today-src DIR takes an extracted tree"
            )
            return None
        subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
        say(f"today: nxd_ckpt as of {args.today_ref} (git archive), in a child process")
    if not os.path.isdir(os.path.join(src, "nxd_ckpt")):
        say(f"{name}: skipped: {src} holds no nxd_ckpt package")
        return None
    out = os.path.join(root, f"today_{len(os.listdir(root))}.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))
    work = os.path.join(root, "today_work")
    os.makedirs(work)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--device",
        kind,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--reps",
        str(args.today_saves),
        "--training-saves",
        str(args.training_saves),
        "--dir",
        work,
        "--today-child",
        out,
        "--today-child-src",
        src,
    ]
    done = subprocess.run(cmd, env=env, check=False)
    shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0 or not os.path.exists(out):
        say(f"{name}: skipped: the child failed (rc {done.returncode})")
        return None
    with open(out) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------- report


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def build_summary(
    run: Run, firsts: list[dict], first_samples: dict[str, list[dict]], today: dict | None, meta: dict
) -> dict[str, Any]:
    r = run.results
    prepared, resumed, resumed_off = (first_samples[k] for k in ("prepared", "resumed", "resumed_off"))

    def col(name: str, key: str, sub: str | None = None) -> list[Any]:
        items = r.get(name, [])
        if sub is not None:
            return [x.get(sub, {}).get(key) for x in items]
        return [x.get(key) if isinstance(x, dict) else x for x in items]

    rows: dict[str, dict[str, Any]] = {}

    def row(label: str, values: list[Any]) -> None:
        values = [v for v in values if v is not None]
        if values:
            rows[label] = {"median": median(values), "all": values}

    row("floor: device->host copy (pinned / bulk) s", r.get("floor_copy_s", []))
    row("floor: device clone + sync s", r.get("floor_clone_s", []))
    row("floor: disk write + fsync s", r.get("floor_disk_s", []))
    row("one training step (synced), no save in flight s", r.get("floor_step_s", []))
    row("nxd first async: blocked s", [f["call_s"] for f in firsts])
    row("nxd first async: next training step (synced) s", [f.get("step_after_s") for f in firsts])
    row("nxd first async: durable s", [f["durable_s"] for f in firsts])
    row("nxd first async: page faults in the call", [f.get("call_minflt") for f in firsts])
    row("nxd first async: graph compiles in the call", [f.get("call_compiles") for f in firsts])
    row("prepare_async_save s", [p.get("prepare_s") for p in prepared])
    row("prepare_async_save: graph compiles", [p.get("prepare_compiles") for p in prepared])
    row("nxd first async after prepare_async_save: blocked s", [p["first"]["call_s"] for p in prepared])
    row("nxd first async after prepare_async_save: durable s", [p["first"]["durable_s"] for p in prepared])
    row(
        "nxd first async after prepare_async_save: graph compiles in the call",
        [p["first"].get("call_compiles") for p in prepared],
    )
    row("resume: load_checkpoint of an async-saved tag (prepares the next save) s", [x["load_s"] for x in resumed])
    row("resume: load_checkpoint: graph compiles", [x["load_compiles"] for x in resumed])
    row("nxd first async after a resume: blocked s", [x["first"]["call_s"] for x in resumed])
    row("nxd first async after a resume: durable s", [x["first"]["durable_s"] for x in resumed])
    row(
        "nxd first async after a resume: graph compiles in the call", [x["first"].get("call_compiles") for x in resumed]
    )
    row("resume, PREPARE_ON_RESUME=0: load_checkpoint s", [x["load_s"] for x in resumed_off])
    row("nxd first async after a resume, PREPARE_ON_RESUME=0: blocked s", [x["first"]["call_s"] for x in resumed_off])
    row(
        "nxd first async after a resume, PREPARE_ON_RESUME=0: graph compiles in the call",
        [x["first"].get("call_compiles") for x in resumed_off],
    )
    for name, label in (
        ("nxd_async", "nxd async xser"),
        ("nxd_async_plain", "nxd async plain"),
        ("nxd_async_nosnap", "nxd async xser, device_snapshot_budget=0"),
        ("dcp_async", "dcp async_save"),
    ):
        row(f"{label}: blocked s", col(name, "call_s"))
        row(f"{label}: report blocked_s", col(name, "blocked_s", "report"))
        row(f"{label}: device_direct_s", col(name, "device_direct_s", "report"))
        row(f"{label}: next training step (synced) s", col(name, "step_after_s"))
        row(f"{label}: durable s", col(name, "durable_s"))
        row(f"{label}: page faults in the call", col(name, "call_minflt"))
        row(f"{label}: graph compiles in the call", col(name, "call_compiles"))
    if today:
        row("today's nxd first async: blocked s", [today["first"]["call_s"]])
        row("today's nxd first async: durable s", [today["first"]["durable_s"]])
        row("today's nxd first async: page faults in the call", [today["first"].get("call_minflt")])
        row("today's nxd first async: next training step (synced) s", [today["first"].get("step_after_s")])
        row("today's nxd async xser: next training step (synced) s", [x.get("step_after_s") for x in today["steady"]])
        row("today's nxd async xser: blocked s", [x["call_s"] for x in today["steady"]])
        row("today's nxd async xser: durable s", [x["durable_s"] for x in today["steady"]])
        mine = today.get("this_tree")
        if mine:
            row("this tree in a child like today's, async xser: blocked s", [x["call_s"] for x in mine["steady"]])
            row(
                "this tree in a child like today's, async xser: next training step (synced) s",
                [x.get("step_after_s") for x in mine["steady"]],
            )
            row("this tree in a child like today's, async xser: durable s", [x["durable_s"] for x in mine["steady"]])
        for who, figures in (("today's", today), ("this tree's", mine)):
            for key, what in (
                ("call_s", "blocked s"),
                ("durable_s", "durable s"),
                ("lost_s", "training time lost s"),
                ("steps", "steps until durable"),
            ):
                if figures and figures.get("training"):
                    row(f"{who} nxd async xser while training goes on: {what}", [x[key] for x in figures["training"]])
    row("step alone: device time s", r.get("step_alone", []))
    row("step + async save before its sync: device time s", r.get("step_save_before_sync", []))
    row("nxd async xser, device filled to within 10%: blocked s", col("pressure", "call_s"))
    row("nxd async xser, device filled to within 10%: durable s", col("pressure", "durable_s"))
    row("nxd sync save (xser) s", col("nxd_sync", "call_s"))
    row("torch.save + fsync s", col("torch_save", "s"))
    row("load: nxd load_checkpoint s", col("load_nxd", "s"))
    row("load: torch.load + load_state_dict s", col("load_torch", "s"))
    row("load: dcp.load + load_state_dict s", col("load_dcp", "s"))

    def m(label: str) -> float | None:
        return rows.get(label, {}).get("median")

    ratios: list[tuple[str, float | None, str]] = []

    def ratio(label: str, a: float | None, b: float | None, target: str = "") -> None:
        ratios.append((label, a / b if a is not None and b else None, target))

    steady = m("nxd async xser: blocked s")
    gpu = run.dev.kind == "cuda"
    ratio(
        "steady async blocked / pinned d2h copy",
        steady,
        m("floor: device->host copy (pinned / bulk) s"),
        "<= 1.5 (GPU)" if gpu else "",
    )
    ratio(
        "steady async blocked / device clone + sync",
        steady,
        m("floor: device clone + sync s"),
        "" if gpu else "<= 1.5 (XLA)",
    )
    ratio("first async blocked / steady async blocked", m("nxd first async: blocked s"), steady, "<= 1.5")
    ratio(
        "async blocked, device filled to within 10% / steady async blocked",
        m("nxd async xser, device filled to within 10%: blocked s"),
        steady,
    )
    ratio(
        "async durable, device filled to within 10% / steady async durable",
        m("nxd async xser, device filled to within 10%: durable s"),
        m("nxd async xser: durable s"),
    )
    ratio(
        "step + save before its sync / step alone (device time)",
        m("step + async save before its sync: device time s"),
        m("step alone: device time s"),
        "<= 1.35",
    )
    ratio(
        "first async after prepare_async_save blocked / steady async blocked",
        m("nxd first async after prepare_async_save: blocked s"),
        steady,
    )
    ratio(
        "first async after a resume blocked / steady async blocked",
        m("nxd first async after a resume: blocked s"),
        steady,
        "<= 1.5",
    )
    ratio(
        "first async after a resume with PREPARE_ON_RESUME=0 blocked / steady async blocked",
        m("nxd first async after a resume, PREPARE_ON_RESUME=0: blocked s"),
        steady,
    )
    ratio(
        "resume load that prepares / resume load with PREPARE_ON_RESUME=0",
        m("resume: load_checkpoint of an async-saved tag (prepares the next save) s"),
        m("resume, PREPARE_ON_RESUME=0: load_checkpoint s"),
    )
    step = m("one training step (synced), no save in flight s")
    ratio("steady async: next training step / a step alone", m("nxd async xser: next training step (synced) s"), step)
    ratio("first async: next training step / a step alone", m("nxd first async: next training step (synced) s"), step)
    ratio("steady async durable / nxd sync save", m("nxd async xser: durable s"), m("nxd sync save (xser) s"))
    ratio(
        "steady async durable / today's async durable",
        m("nxd async xser: durable s"),
        m("today's nxd async xser: durable s"),
    )
    ratio(
        "steady async durable, each in a child of its own: this tree / today's",
        m("this tree in a child like today's, async xser: durable s"),
        m("today's nxd async xser: durable s"),
        "<= 1.0 (no worse)",
    )
    ratio(
        "async durable while training goes on, each in a child of its own: this tree / today's",
        m("this tree's nxd async xser while training goes on: durable s"),
        m("today's nxd async xser while training goes on: durable s"),
        "<= 1.0 (no worse)",
    )
    ratio(
        "training time lost to an async save while training goes on: this tree / today's",
        m("this tree's nxd async xser while training goes on: training time lost s"),
        m("today's nxd async xser while training goes on: training time lost s"),
    )
    ratio(
        "steady async durable / device_snapshot_budget=0 durable",
        m("nxd async xser: durable s"),
        m("nxd async xser, device_snapshot_budget=0: durable s"),
    )
    ratio("steady async blocked / today's async blocked", steady, m("today's nxd async xser: blocked s"))
    ratio(
        "steady async blocked / device_snapshot_budget=0 blocked",
        steady,
        m("nxd async xser, device_snapshot_budget=0: blocked s"),
    )
    ratio(
        "today's first async blocked / nxd first async blocked",
        m("today's nxd first async: blocked s"),
        m("nxd first async: blocked s"),
    )
    ratio("steady async blocked / dcp async_save blocked", steady, m("dcp async_save: blocked s"))
    ratio("nxd sync save / disk floor", m("nxd sync save (xser) s"), m("floor: disk write + fsync s"))
    ratio("torch.save / nxd sync save (speed-up)", m("torch.save + fsync s"), m("nxd sync save (xser) s"))
    ratio(
        "torch.load + load_state_dict / nxd load (speed-up)",
        m("load: torch.load + load_state_dict s"),
        m("load: nxd load_checkpoint s"),
        ">= 1.0",
    )
    ratio("dcp.load / nxd load (speed-up)", m("load: dcp.load + load_state_dict s"), m("load: nxd load_checkpoint s"))

    memory: dict[str, Any] = {}

    def mem(label: str, values: list[Any]) -> None:
        values = [v for v in values if v is not None]
        memory[label] = max(values) if values else None

    mem("nxd first async: extra device memory (peak)", [f.get("dev_peak") for f in firsts])
    mem("nxd first async: device_snapshot_bytes", [f["report"].get("device_snapshot_bytes") for f in firsts])
    mem("nxd first async: extra host memory (resident)", [f.get("first_host_rss") for f in firsts])
    for name, label in (
        ("nxd_async", "nxd async xser"),
        ("nxd_async_plain", "nxd async plain"),
        ("nxd_async_nosnap", "nxd async, budget 0"),
        ("nxd_sync", "nxd sync"),
        ("dcp_async", "dcp async_save"),
    ):
        mem(f"{label}: extra device memory (peak)", col(name, "dev_peak"))
        if name.startswith("nxd_async"):
            mem(f"{label}: device_snapshot_bytes", col(name, "device_snapshot_bytes", "report"))
    for name, label in (("load_nxd", "nxd load"), ("load_torch", "torch.load"), ("load_dcp", "dcp.load")):
        mem(f"{label}: extra device memory (peak)", col(name, "dev_peak"))
    mem("nxd async (untimed run): extra host memory", col("mem_async", "host_extra"))
    mem("nxd sync (untimed run): extra host memory", col("mem_sync", "host_extra"))
    mem("nxd load (untimed run): extra host memory", col("mem_load", "host_extra"))
    return {
        "meta": meta,
        "rows": rows,
        "ratios": [{"ratio": a, "value": b, "target": c} for a, b, c in ratios],
        "memory": memory,
        "first": firsts,
        "first_after_prepare": prepared,
        "first_after_resume": resumed,
        "first_after_resume_unprepared": resumed_off,
        "today": today,
        "results": run.results,
        "errors": run.errors,
        "checks": run.checks,
    }


def print_summary(summary: dict[str, Any]) -> None:
    meta = summary["meta"]
    say()
    say(
        f"## {meta['device']}: {meta['state_gb']:.3f} GB of fp32 state ({meta['tensors']} tensors), "
        f"{meta['reps']} reps (median), loads {'cold' if meta['cold'] else 'WARM (' + meta['warm_why'] + ')'}"
    )
    say(
        f"{meta['versions']}; nxd_ckpt from {meta['nxd_ckpt']}; load average {meta['load_start']:.2f} at start, "
        f"{meta['load_end']:.2f} at end"
    )
    say()
    say("| measurement | median | GB/s | all |")
    say("|---|---:|---:|---|")
    gb = meta["state_gb"]
    for label, v in summary["rows"].items():
        rate = f"{gb / v['median']:.2f}" if v["median"] and "device_direct" not in label else ""
        say(f"| {label} | {v['median']:.3f} | {rate} | {', '.join(f'{x:.3f}' for x in v['all'])} |")
    say()
    say("| ratio | value | target |")
    say("|---|---:|---|")
    for r in summary["ratios"]:
        value = f"{r['value']:.2f}" if r["value"] is not None else "n/a"
        say(f"| {r['ratio']} | {value} | {r['target']} |")
    say()
    say("| memory (largest) | bytes |")
    say("|---|---:|")
    for label, v in summary["memory"].items():
        say(f"| {label} | {fmt_bytes(v)} |")
    if summary["checks"]:
        say()
        for what, outcome in summary["checks"].items():
            say(f"check: {what}: {outcome}")
    for name, error in summary["errors"].items():
        say(f"FAILED: {name}: {error.splitlines()[0] if error else ''}")


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "xla"), default="auto")
    parser.add_argument("--size-gb", type=float, default=None, help="GiB of fp32 state (default: 10 CUDA, 0.4 XLA)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default: 3 CUDA, 5 XLA)")
    parser.add_argument(
        "--steady", type=int, default=None, help="steady nxd async xser saves per repetition (default: 1 CUDA, 2 XLA)"
    )
    parser.add_argument(
        "--training-saves",
        type=int,
        default=None,
        help="saves while training goes on, in each of the today and this-tree children (default: 1 CUDA, 5 XLA)",
    )
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: from --size-gb)")
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--skip",
        default=None,
        help=f"comma-separated rows to leave out, of: {','.join(ROWS)} (default: {','.join(CUDA_SKIP)} on CUDA, "
        f"{','.join(XLA_SKIP)} on XLA, to keep the default runs within 6 and 4 minutes; 'none': run every row)",
    )
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a new directory under /tmp)")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    parser.add_argument("--today-ref", default=TODAY_REF, help="git commit of today's nxd_ckpt (default %(default)s)")
    parser.add_argument("--today-src", default=None, help="a directory holding today's nxd_ckpt package instead")
    parser.add_argument(
        "--today-saves", type=int, default=None, help="steady saves of the today child (default: 1 CUDA, 5 XLA)"
    )
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument(
        "--first-runs", type=int, default=None, help="fresh processes for first saves (default: 2 XLA, 1 CUDA)"
    )
    parser.add_argument("--first-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first-prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--first-resume", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--write-resume-tag", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--today-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--today-child-src", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.today_child:
        return today_child(args)
    if args.first_child or args.write_resume_tag:
        return first_child(args)
    kind = pick_device(args.device)
    cuda = kind == "cuda"
    skip = args.skip if args.skip is not None else ",".join(CUDA_SKIP if cuda else XLA_SKIP)
    args.skip = {s for s in skip.split(",") if s and s != "none"}
    if args.skip - set(ROWS):
        parser.error(f"unknown rows in --skip: {sorted(args.skip - set(ROWS))}; choose from {','.join(ROWS)}")
    args.size_gb = args.size_gb if args.size_gb is not None else (10.0 if cuda else 0.4)
    args.reps = args.reps if args.reps is not None else (3 if cuda else 5)
    args.steady = args.steady if args.steady is not None else (1 if cuda else 2)
    args.today_saves = args.today_saves if args.today_saves is not None else (1 if cuda else 5)
    args.training_saves = args.training_saves if args.training_saves is not None else (1 if cuda else 5)
    args.first_runs = args.first_runs if args.first_runs is not None else (1 if cuda else 2)
    args.hidden, layers = layout_for(int(args.size_gb * GIB), args.hidden)
    args.layers = args.layers or layers

    import nxd_ckpt

    dev = Device(kind)
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    say(f"command: {os.path.basename(sys.executable)} {' '.join(sys.argv)}")
    say(f"device: {dev.name()}; {dev.versions()}; nxd_ckpt from {os.path.dirname(nxd_ckpt.__file__)}")
    say(f"load average (1 min) at start: {load_start:.2f}; {os.cpu_count()} CPUs")
    root = tempfile.mkdtemp(prefix="nxd_bench_device_", dir=args.dir)
    cache = PageCache(args.warm)
    loads = "cold (page cache dropped before each)" if cache.cold else f"WARM: {cache.why}"
    say(f"checkpoints in {root}; loads {loads}")
    today = None
    run: Run | None = None
    try:
        if "today" not in args.skip:  # first: its child process has the machine to itself
            today = run_today(args, kind, root)
            if today is not None:  # and this tree's saves measured the same way, for durable times
                today["this_tree"] = run_today(args, kind, root, src=REPO)
        first_samples = run_first_children(args, kind, root)
        tr = Training(dev, args.hidden, args.layers)
        tr.steps(3)  # AdamW state exists; on XLA the steady step graph is compiled
        init_process_group()
        tensors = tr.tensors()
        state_bytes = nbytes(tensors)
        say(
            f"state: {state_bytes / 1e9:.3f} GB ({state_bytes / GIB:.3f} GiB) in {len(tensors)} tensors: hidden "
            f"{args.hidden}, {args.layers} blocks, model {nbytes(list(tr.model.parameters())) / 1e9:.3f} GB + AdamW "
            f"(built and trained 3 steps {time.perf_counter() - began:.0f} s into the run)"
        )
        first = None
        try:
            first = first_async(dev, tr, root)
            say(f"first async save of the process (xser): {describe_save(first)}")
        except Exception:
            say("first async save: FAILED")
            traceback.print_exc()
        run = Run(args, dev, tr, root, cache)
        blocks: list[Callable[[], None]] = [
            run.floors,
            lambda: run.nxd_async("nxd_async", "nxd async xser", xser=True, count=args.steady),
        ]
        if run.on("async_plain"):
            blocks.append(lambda: run.nxd_async("nxd_async_plain", "nxd async plain", xser=False))
        if run.on("async_nosnap"):
            if accepts(nxd_ckpt.save_checkpoint, "device_snapshot_budget"):
                blocks.append(
                    lambda: run.nxd_async(
                        "nxd_async_nosnap",
                        "nxd async xser, device_snapshot_budget=0",
                        xser=True,
                        extra={"device_snapshot_budget": 0},
                    )
                )
            else:
                say("nxd async with device_snapshot_budget=0: skipped (this nxd_ckpt has no such keyword)")
        blocks.append(run.saves_and_loads)
        if run.on("before_sync"):
            blocks.append(run.before_sync)
        for rep in range(args.reps):
            run.rep = rep
            if run.check:
                run.check_async_snapshot()
            k = rep % len(blocks)
            for block in blocks[k:] + blocks[:k]:
                block()
        dev.drop_floor_buffers()
        run.phase = "memory"
        if run.on("memory"):
            run.memory()
        run.phase = "pressure"
        if run.on("pressure"):
            run.pressure()
        nxd_ckpt.finalize_checkpoint()
        if run.dcp_stager is not None:
            run.dcp_stager.close()
        meta = {
            "device": dev.name(),
            "kind": kind,
            "versions": dev.versions(),
            "nxd_ckpt": os.path.dirname(nxd_ckpt.__file__),
            "state_bytes": state_bytes,
            "state_gb": state_bytes / 1e9,
            "tensors": len(tensors),
            "hidden": args.hidden,
            "blocks": args.layers,
            "reps": args.reps,
            "steady_per_rep": args.steady,
            "cold": cache.cold,
            "warm_why": cache.why,
            "dcp_staging_options": run.dcp_options,
            "dcp_via_host_copies": run.dcp_via_host,
            "dcp_new_stager_each_save": run.dcp_fresh,
            "torch_load_map_location": str(dev.device) if cuda else "cpu",
            "load_start": load_start,
            "load_end": os.getloadavg()[0],
            "command": sys.argv,
        }
        firsts = [f for f in [first, *(c["first"] for c in first_samples["plain"])] if f is not None]
        summary = build_summary(run, firsts, first_samples, today, meta)
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1, default=str)
            say(f"figures written to {args.json}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
