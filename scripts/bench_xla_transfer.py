"""Measure XLA device->host transfers: per-tensor ``.cpu()`` vs bulk, and async staging on a background thread.

Run in the XLA environment:  PJRT_DEVICE=CPU $(bash scripts/setup_env.sh xla | tail -1) scripts/bench_xla_transfer.py

Part 1 (throughput): the same materialised state is fetched by per-tensor ``.cpu()``, by one bulk
``_xla_get_cpu_tensors`` call, and by ``nxd_ckpt.xla.to_cpu`` (one sync + bulk batches of --batch-mib);
methods are interleaved within each repeat and medians are reported (the machine is shared and noisy).
Part 2 (async): what an async save blocks on today (``xla.to_cpu`` of the whole state) vs taking a
``device.snapshot.take`` (on-device copy under one sync) and fetching it on a writer thread while training steps run;
it reports the blocked time, the background transfer time, the training step time with and without the
transfer running, and checks that the background result equals a synchronous fetch taken at snapshot time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla

from nxd_ckpt import xla
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import SnapshotBudget

MIB = 1 << 20


def _state(total_mib: int, count: int, device: torch.device) -> list[torch.Tensor]:
    per = total_mib * MIB // 4 // count
    tensors = [torch.randn(per).to(device) * 1.0 for _ in range(count)]  # "* 1.0": pending graphs, as after a step
    torch_xla.sync(wait=True)
    return tensors


def _timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def bench_throughput(total_mib: int, layouts: list[int], repeats: int, batch_mib: int) -> list[dict]:
    device = torch_xla.device()
    rows = []
    for count in layouts:
        tensors = _state(total_mib, count, device)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        methods = {
            "per-tensor .cpu()": lambda ts=tensors: [t.cpu() for t in ts],
            "bulk, one call": lambda ts=tensors: torch_xla._XLAC._xla_get_cpu_tensors(ts),
            f"xla.to_cpu, {batch_mib} MiB batches": lambda ts=tensors: xla.to_cpu(ts, batch_bytes=batch_mib * MIB),
        }
        for fn in methods.values():  # warm-up: first-touch of host memory is slow in this VM
            _timed(fn)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(repeats):
            for name, fn in methods.items():
                times[name].append(_timed(fn))
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "tensors": count,
                    "bytes": nbytes,
                    "method": name,
                    "median_s": round(med, 4),
                    "gb_per_s": round(nbytes / med / 1e9, 3),
                    "all_s": [round(t, 4) for t in ts],
                }
            )
        del tensors
    return rows


class _Model(torch.nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int, i: int) -> float:
    device = torch_xla.device()
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, width, generator=g).to(device)
    start = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch_xla.sync(wait=True)
    return time.perf_counter() - start


def bench_async(width: int, layers: int, repeats: int, steps: int, batch_mib: int) -> dict:
    device = torch_xla.device()
    torch.manual_seed(0)
    model = _Model(width, layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(3):  # compile, create optimizer state
        _step(model, opt, width, i)

    def state() -> list[torch.Tensor]:
        out = list(model.state_dict().values())
        return out + [v for s in opt.state.values() for v in s.values() if v.device.type == "xla"]

    nbytes = sum(t.numel() * t.element_size() for t in state())
    results: dict[str, list[float]] = {k: [] for k in ("sync_blocked_s", "snapshot_blocked_s", "background_s")}
    quiet_steps: list[float] = []
    busy_steps: list[float] = []
    exact = True
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxd_ckpt_writer")
    step_no = 10
    for _ in range(repeats):
        for _ in range(steps):  # training alone
            step_no += 1
            quiet_steps.append(_step(model, opt, width, step_no))
        results["sync_blocked_s"].append(_timed(lambda: xla.to_cpu(state(), batch_bytes=batch_mib * MIB)))

        start = time.perf_counter()
        tensors = state()
        snapshot = device_snapshot.take(tensors, SnapshotBudget(None), chunk_bytes=batch_mib * MIB)
        results["snapshot_blocked_s"].append(time.perf_counter() - start)
        reference = xla.to_cpu(state(), batch_bytes=batch_mib * MIB)  # values at snapshot time (not timed)
        done = threading.Event()
        span: list[float] = []

        def transfer(s=snapshot, ts=tensors, span=span, done=done) -> list[torch.Tensor]:
            t0 = time.perf_counter()
            out = [s.transfer.host(s.stand_ins[id(t)]) for t in ts]  # arriving on the snapshot's own thread
            s.transfer.close()
            span.append(time.perf_counter() - t0)
            done.set()
            return out

        future = writer.submit(transfer)
        while not done.is_set():  # training continues while the writer thread transfers
            step_no += 1
            busy_steps.append(_step(model, opt, width, step_no))
        host = future.result()
        results["background_s"].append(span[0])
        exact = exact and all(torch.equal(a, b) for a, b in zip(host, reference, strict=True))
        del host, reference
    writer.shutdown(wait=True)
    return {
        "state_bytes": nbytes,
        **{k: round(statistics.median(v), 4) for k, v in results.items()},
        "step_s_alone": round(statistics.median(quiet_steps), 4),
        "step_s_during_transfer": round(statistics.median(busy_steps), 4) if busy_steps else None,
        "steps_overlapped": len(busy_steps),
        "background_result_exact": exact,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size for the throughput part")
    ap.add_argument("--layouts", default="1,64", help="tensor counts the state is split into")
    ap.add_argument("--batch-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048, help="async part: Linear width (params+AdamW = 3x)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="async part: training steps between saves")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-async", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    out: dict = {}
    if not args.skip_throughput:
        rows = bench_throughput(args.mib, [int(x) for x in args.layouts.split(",")], args.repeats, args.batch_mib)
        out["throughput"] = rows
        print(f"\n== device->host, {args.mib} MiB float32, medians of {args.repeats} ==")
        for r in rows:
            print(f"{r['tensors']:>4} tensors  {r['method']:<32} {r['median_s']:>8.3f} s  {r['gb_per_s']:>6.2f} GB/s")
    if not args.skip_async:
        res = bench_async(args.width, args.layers, args.repeats, args.steps, args.batch_mib)
        out["async"] = res
        print(f"\n== async staging, {res['state_bytes'] / MIB:.0f} MiB of model + AdamW state ==")
        for key, value in res.items():
            print(f"{key:<26} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
