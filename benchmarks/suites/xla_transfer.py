"""XLA device->host transfers: per-tensor ``.cpu()`` vs bulk, and async staging on a background thread.

    PJRT_DEVICE=CPU $(bash scripts/setup_env.sh xla | tail -1) -m benchmarks xla_transfer

Section ``throughput``: the same materialised state is fetched by per-tensor ``.cpu()``, by one bulk
``_xla_get_cpu_tensors`` call, and by ``nxd_ckpt.xla.to_cpu`` (one sync + bulk batches of --batch-mib); methods are
interleaved within each repeat and medians are reported. Section ``async``: what an async save blocks on with
``xla.to_cpu`` of the whole state vs taking a ``device.snapshot.take`` (on-device copy under one sync) and fetching
it on a writer thread while training steps run; it reports the blocked time, the background transfer time, the
training step time with and without the transfer running, and checks that the background result equals a
synchronous fetch taken at snapshot time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.core.report import Report
from benchmarks.core.timing import seconds

TITLE = __doc__.splitlines()[0]
SECTIONS = {
    "throughput": "per-tensor .cpu(), one bulk call, xla.to_cpu in batches",
    "async": "the blocked time of a sync fetch against a snapshot fetched on a thread while training runs",
}
MIB = 1 << 20


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--mib", type=int, default=1024, help="state size for the throughput section")
    parser.add_argument("--layouts", default="1,64", help="tensor counts the state is split into")
    parser.add_argument("--batch-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048, help="async section: Linear width (params+AdamW = 3x)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="async section: training steps between saves")


def _state(total_mib: int, count: int, device: Any) -> list[torch.Tensor]:
    """``count`` tensors on the device, ``total_mib`` in all, pending graphs materialised (as after a step)."""
    import torch_xla

    per = total_mib * MIB // 4 // count
    tensors = [torch.randn(per).to(device) * 1.0 for _ in range(count)]  # "* 1.0": pending graphs, as after a step
    torch_xla.sync(wait=True)
    return tensors


def throughput_rows(count: int, total_mib: int, repeats: int, batch_mib: int) -> list[dict]:
    """The three fetch methods on one layout, interleaved, medians."""
    import torch_xla

    from nxd_ckpt import xla

    tensors = _state(total_mib, count, torch_xla.device())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    methods = {
        "per-tensor .cpu()": lambda: [t.cpu() for t in tensors],
        "bulk, one call": lambda: torch_xla._XLAC._xla_get_cpu_tensors(tensors),
        f"xla.to_cpu, {batch_mib} MiB batches": lambda: xla.to_cpu(tensors, batch_bytes=batch_mib * MIB),
    }
    for fn in methods.values():  # warm-up: first-touch of host memory is slow in this VM
        seconds(fn)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            times[name].append(seconds(fn))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"tensors": count, "bytes": nbytes, "method": name, "median_s": round(med, 4),
                     "gb_per_s": round(nbytes / med / 1e9, 3), "all_s": [round(t, 4) for t in ts]})  # fmt: skip
    return rows


class _Model(torch.nn.Module):
    """``layers`` Linear layers of ``width`` with tanh."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Trainer:
    """The async section's model, AdamW and numbered steps on the XLA device."""

    def __init__(self, width: int, layers: int) -> None:
        import torch_xla

        torch.manual_seed(0)
        self.width, self.step_no = width, 0
        self.model = _Model(width, layers).to(torch_xla.device())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        for _ in range(3):  # compile, create optimizer state
            self.step()

    def step(self) -> float:
        """One synced training step; its seconds."""
        import torch_xla

        self.step_no += 1
        x = torch.randn(64, self.width, generator=torch.Generator().manual_seed(self.step_no)).to(torch_xla.device())
        start = time.perf_counter()
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        torch_xla.sync(wait=True)
        return time.perf_counter() - start

    def state(self) -> list[torch.Tensor]:
        """The model's and the optimizer's device tensors."""
        out = list(self.model.state_dict().values())
        return out + [v for s in self.opt.state.values() for v in s.values() if v.device.type == "xla"]


def background_fetch(tr: Trainer, writer: ThreadPoolExecutor, batch_mib: int, busy: list[float]) -> tuple:
    """A snapshot taken in the call, fetched on the writer thread while steps run: (blocked, background seconds,
    whether the result equals a sync fetch at snapshot time)."""
    from nxd_ckpt import xla
    from nxd_ckpt.device import snapshot as device_snapshot
    from nxd_ckpt.device.backend import SnapshotBudget

    start = time.perf_counter()
    tensors = tr.state()
    snapshot = device_snapshot.take(tensors, SnapshotBudget(None), chunk_bytes=batch_mib * MIB)
    blocked = time.perf_counter() - start
    reference = xla.to_cpu(tr.state(), batch_bytes=batch_mib * MIB)  # values at snapshot time (not timed)
    done, span = threading.Event(), []

    def transfer() -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = [snapshot.transfer.host(snapshot.stand_ins[id(t)]) for t in tensors]  # on the snapshot's own thread
        snapshot.transfer.close()
        span.append(time.perf_counter() - t0)
        done.set()
        return out

    future = writer.submit(transfer)
    while not done.is_set():  # training continues while the writer thread transfers
        busy.append(tr.step())
    host = future.result()
    return blocked, span[0], all(torch.equal(a, b) for a, b in zip(host, reference, strict=True))


def bench_async(width: int, layers: int, repeats: int, steps: int, batch_mib: int) -> dict:
    """The async section: sync fetch vs snapshot + background fetch, with training steps alone and beside it."""
    from nxd_ckpt import xla

    tr = Trainer(width, layers)
    nbytes = sum(t.numel() * t.element_size() for t in tr.state())
    results: dict[str, list[float]] = {k: [] for k in ("sync_blocked_s", "snapshot_blocked_s", "background_s")}
    quiet: list[float] = []
    busy: list[float] = []
    exact = True
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxd_ckpt_writer")
    for _ in range(repeats):
        quiet += [tr.step() for _ in range(steps)]  # training alone
        results["sync_blocked_s"].append(seconds(lambda: xla.to_cpu(tr.state(), batch_bytes=batch_mib * MIB)))
        blocked, background, same = background_fetch(tr, writer, batch_mib, busy)
        results["snapshot_blocked_s"].append(blocked)
        results["background_s"].append(background)
        exact = exact and same
    writer.shutdown(wait=True)
    return {"state_bytes": nbytes, **{k: round(statistics.median(v), 4) for k, v in results.items()},
            "step_s_alone": round(statistics.median(quiet), 4),
            "step_s_during_transfer": round(statistics.median(busy), 4) if busy else None,
            "steps_overlapped": len(busy), "background_result_exact": exact}  # fmt: skip


def run(args: argparse.Namespace, report: Report) -> int:
    """The sections asked for."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    sections = args.sections or list(SECTIONS)
    report.say(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    if "throughput" in sections:
        rows = report.data["throughput"] = [r for count in args.layouts.split(",")
                                            for r in throughput_rows(int(count), args.mib, args.repeats,
                                                                     args.batch_mib)]  # fmt: skip
        report.say(f"== device->host, {args.mib} MiB float32, medians of {args.repeats} ==")
        for r in rows:
            report.say(f"{r['tensors']:>4} tensors  {r['method']:<32} {r['median_s']:>8.3f} s  "
                       f"{r['gb_per_s']:>6.2f} GB/s")  # fmt: skip
    if "async" in sections:
        res = report.data["async"] = bench_async(args.width, args.layers, args.repeats, args.steps, args.batch_mib)
        report.say(f"== async staging, {res['state_bytes'] / MIB:.0f} MiB of model + AdamW state ==")
        for key, value in res.items():
            report.say(f"{key:<26} {value}")
    return 0
