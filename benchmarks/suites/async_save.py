"""Async save benchmark: what ``save_checkpoint(async_save=True)`` costs the training loop.

    $(bash scripts/setup_env.sh cpu | tail -1) -m benchmarks async [--total-gib 2] [--repeats 3]

State: a transformer-like fp32 model (hidden 1536) replicated on --ranks processes plus AdamW
``exp_avg``/``exp_avg_sq`` split ZeRO-1 style, --total-gib of tensor data in all. Every repeat runs, in the same
processes and interleaved, on every rank at once (barrier before each):
  memcpy      copying this rank's saved bytes into an already-allocated, already-touched host buffer;
  nxd async   ``save_checkpoint(async_save=True)``: time blocked in the call, and time until durable and
              committed (``done`` written, known on every rank);
  nxd sync    ``save_checkpoint()`` of the same state (blocked = total);
  dcp async   ``torch.distributed.checkpoint.async_save``: time until it returns, and until its future is done.
A first, untimed async save allocates the staging buffers; its blocked time (``benchmarks.measure.first_save``)
and memory are reported apart. Peak extra host memory is the largest RSS growth over the process's RSS before
any checkpointing, sampled every 2 ms during the first async save (buffers allocated) and the second (buffers
reused; measured before DCP runs, whose freed memory can stay in the heap), relative to the bytes the largest
rank saves. Medians over repeats; each figure is the slowest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from benchmarks.core.baselines import aligned_views, copy_into
from benchmarks.core.memory import ResidentPeak, resident_bytes
from benchmarks.core.ranks import gather, on_ranks, slowest, write_result
from benchmarks.core.report import Report
from benchmarks.core.state import nbytes_of, tensors_of, transformer_state
from benchmarks.measure.first_save import probe

TITLE = __doc__.splitlines()[0]
SECTIONS = {"async": "memcpy, nxd async, nxd sync and DCP async_save, interleaved; first and steady memory"}
GIB = 1 << 30


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--total-gib", type=float, default=2.0, help="tensor data of the whole state (all ranks)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1536, help="hidden size of the synthetic layers")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")


def _clean(path: str) -> None:
    """Rank 0 removes ``path`` between two barriers."""
    import shutil

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


class AsyncBench:
    """One rank's state, its saved tensors, their memcpy destinations and the save arguments."""

    def __init__(self, root: str, total_bytes: int, hidden: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.root = rank, root
        self.model, self.optimizer = transformer_state(total_bytes, rank, world, hidden)
        self.saved = (tensors_of(self.model) if rank == 0 else []) + tensors_of(self.optimizer)  # rank 0: the model
        self.views = aligned_views(self.saved)
        self.kw = {"model": self.model, "optimizer": self.optimizer, "zero1_optimizer": True}
        self.ckpt = os.path.join(root, "nxd")

    def memcpy_s(self) -> float:
        """The slowest rank's memcpy of its saved bytes into the touched buffer."""
        dist.barrier()
        return slowest(copy_into(self.saved, self.views))

    def dcp_async(self, directory: str) -> tuple[float, float]:
        """DCP's async_save: (blocked, until its future is done)."""
        import torch.distributed.checkpoint as dcp

        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save({"model": self.model, f"optim_{self.rank}": self.optimizer}, checkpoint_id=directory)
        blocked = time.perf_counter() - start
        future.result()  # before any collective of ours: DCP's background thread uses the default group
        return blocked, time.perf_counter() - start


def first_saves(b: AsyncBench) -> tuple[dict[str, float], float]:
    """The first async save (buffers allocated) and the second (reused): blocked time and peak extra memory
    over the process's resident memory before any checkpointing; then DCP's first, untimed."""
    import nxd_ckpt as nxd

    rss_base = resident_bytes()
    dist.barrier()
    with ResidentPeak() as first_mem:
        report, figures = probe(lambda: nxd.save_checkpoint(b.ckpt, "warmup", async_save=True, **b.kw))
        report.wait()
    dist.barrier()
    first = {"blocked_s": slowest(figures["blocked_s"]), "peak_extra_bytes": slowest(first_mem.peak - rss_base)}
    _clean(b.ckpt)
    dist.barrier()
    with ResidentPeak() as steady_mem:
        nxd.save_checkpoint(b.ckpt, "steady", async_save=True, **b.kw).wait()
    dist.barrier()
    steady_extra = slowest(steady_mem.peak - rss_base)
    _clean(b.ckpt)
    b.dcp_async(os.path.join(b.root, "dcp_w"))
    _clean(os.path.join(b.root, "dcp_w"))
    return first, steady_extra


def one_repeat(b: AsyncBench, rep: int) -> dict[str, float]:
    """memcpy, nxd async (memcpy again right after), nxd sync and DCP async, in turn: the slowest rank's times."""
    import nxd_ckpt as nxd

    row = {"memcpy_s": b.memcpy_s()}
    dist.barrier()
    start = time.perf_counter()
    report = nxd.save_checkpoint(b.ckpt, f"async_{rep}", async_save=True, **b.kw)
    blocked = time.perf_counter() - start
    report.wait()  # rank 0: 'done' written; other ranks: the commit outcome is known
    total = time.perf_counter() - start
    row["memcpy_after_s"] = b.memcpy_s()  # again right after: the load of this shared machine drifts within seconds
    row |= {"nxd_async_blocked_s": slowest(blocked), "nxd_async_total_s": slowest(total)}
    row["nxd_async_staging_s"] = slowest(report.staging_s)
    row["nxd_async_staging_allocated_bytes"] = slowest(report.staging_allocated_bytes)
    _clean(b.ckpt)
    dist.barrier()
    start = time.perf_counter()
    nxd.save_checkpoint(b.ckpt, f"sync_{rep}", **b.kw)
    row["nxd_sync_s"] = slowest(time.perf_counter() - start)
    _clean(b.ckpt)
    dcp_dir = os.path.join(b.root, f"dcp_{rep}")
    dcp_blocked, dcp_total = b.dcp_async(dcp_dir)
    row |= {"dcp_async_blocked_s": slowest(dcp_blocked), "dcp_async_total_s": slowest(dcp_total)}
    _clean(dcp_dir)
    return row


def ratios(rows: list[dict[str, float]], first: dict[str, float], steady_extra: float, largest: int) -> dict:
    """The medians, the target ratios and the per-repeat ratios (robust to drift: paired with the memcpy runs
    just before and after each async save)."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    paired = {
        "blocked / memcpy": [r["nxd_async_blocked_s"] * 2 / (r["memcpy_s"] + r["memcpy_after_s"]) for r in rows],
        "async total / sync total": [r["nxd_async_total_s"] / r["nxd_sync_s"] for r in rows],
    }
    pm: Callable[[str], float] = lambda key: statistics.median(paired[key])  # noqa: E731
    out = {
        "blocked / memcpy (target <= 1.25)": med["nxd_async_blocked_s"] / med["memcpy_s"],
        "median of per-repeat blocked / memcpy (target <= 1.25)": pm("blocked / memcpy"),
        "median of per-repeat async total / sync total (target <= 1.1)": pm("async total / sync total"),
        "blocked / dcp async blocked (target < 1)": med["nxd_async_blocked_s"] / med["dcp_async_blocked_s"],
        "async total / sync total (target <= 1.1)": med["nxd_async_total_s"] / med["nxd_sync_s"],
        "dcp async total / nxd sync total": med["dcp_async_total_s"] / med["nxd_sync_s"],
        "peak extra memory / saved bytes, steady (target <= 1.1)": steady_extra / largest,
        "peak extra memory / saved bytes, first save": first["peak_extra_bytes"] / largest,
        "first async save blocked / memcpy": first["blocked_s"] / med["memcpy_s"],
    }
    return {"median": med, "ratios": out, "per_repeat_ratios": paired}


def worker(total_bytes: int, hidden: int, repeats: int, root: str, out: str) -> None:
    """One rank: the first saves, the repeats, and (rank 0) the result."""
    import nxd_ckpt as nxd

    b = AsyncBench(root, total_bytes, hidden)
    first, steady_extra = first_saves(b)
    rows = []
    for rep in range(repeats):
        rows.append(one_repeat(b, rep))
        if b.rank == 0:
            print(f"repeat {rep}: " + ", ".join(f"{k}={v:.3f}" for k, v in rows[-1].items() if k.endswith("_s")),
                  flush=True)  # fmt: skip
    nxd.finalize_checkpoint()
    per_rank = gather((nbytes_of(b.saved), nbytes_of([b.model, b.optimizer])))
    result: dict[str, Any] = {"ranks": dist.get_world_size(), "total_state_gib": total_bytes / GIB}
    result |= {"saved_bytes_per_rank": [s for s, _ in per_rank], "state_bytes_per_rank": [s for _, s in per_rank]}
    result |= {"repeats": rows, "first_async_save": first, "steady_async_save_peak_extra_bytes": steady_extra}
    result |= ratios(rows, first, steady_extra, max(s for s, _ in per_rank))
    write_result(out, result)


def run(args: argparse.Namespace, report: Report) -> int:
    """Spawn the ranks and report the medians and ratios."""
    with tempfile.TemporaryDirectory(prefix="nxd_bench_async_", dir=args.dir) as root:
        kwargs = {"total_bytes": int(args.total_gib * GIB), "hidden": args.hidden, "repeats": args.repeats}
        kwargs["root"] = root
        result = report.data["async"] = on_ranks(worker, args.ranks, kwargs)
    report.say(f"== async section: {result['total_state_gib']:.2f} GiB state on {result['ranks']} ranks ==")
    report.say(f"bytes saved per rank: {result['saved_bytes_per_rank']}")
    for key, value in result["median"].items():
        unit = f"{value / GIB:8.3f} GiB" if key.endswith("bytes") else f"{value:8.3f} s"
        report.say(f"  median {key:32s} {unit}")
    report.say(f"  first async save: blocked {result['first_async_save']['blocked_s']:.3f} s")
    for key, value in result["ratios"].items():
        report.say(f"  {key:64s} {value:6.2f}")
    for key, values in result["per_repeat_ratios"].items():
        report.say(f"  per repeat {key}: " + " ".join(f"{v:.2f}" for v in values))
    return 0
