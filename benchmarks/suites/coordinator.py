"""Cost of a deadline-guarded cross-rank step next to the bare collective it wraps, on real gloo ranks.

Each ``Coordinator.master_computes`` step checks in on the c10d store (so a missing rank is named and the wait
has a deadline) before its one broadcast; this measures that step against a bare ``broadcast_object_list`` of
the same payload, and ``run_all`` against a bare ``all_gather_object``, and prints the ratios. A save issues one
or two such steps, a load four to six.

    python -m benchmarks coordinator --ranks 2 --steps 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from benchmarks.core.ranks import on_ranks, write_result
from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {"steps": "master_computes, run_all and a store barrier against the bare collectives (mean per step)"}

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the test harness, harness/


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)


def worker(steps: int, out: str) -> None:
    """One rank: each step kind ``steps`` times after one warm-up; rank 0 writes the means."""
    import torch.distributed as tdist

    from nxd_ckpt.ranks.coordinator import Coordinator

    rank, world = tdist.get_rank(), tdist.get_world_size()
    coord = Coordinator()
    payload = {"tag": "step_1000", "created_at": time.time(), "files": [f"f{i}" for i in range(32)]}

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps

    def bare_broadcast() -> None:
        tdist.broadcast_object_list([payload if rank == 0 else None], src=0)

    def bare_gather() -> None:
        tdist.all_gather_object([None] * world, None)

    write_result(out, {
        "bare broadcast_object_list": timed(bare_broadcast),
        "master_computes (store check-in + broadcast)": timed(lambda: coord.master_computes(lambda: payload, "bench")),
        "bare all_gather_object": timed(bare_gather),
        "run_all (store check-in + all_gather)": timed(lambda: coord.run_all(lambda: None, "bench")),
        "barrier (store only)": timed(lambda: coord.barrier("bench")),
    })  # fmt: skip


def run(args: argparse.Namespace, report: Report) -> int:
    """Spawn the ranks and report the means and ratios."""
    os.environ.setdefault("NXD_CKPT_TIMEOUT_S", "120")
    results = report.data["steps"] = on_ranks(worker, args.ranks, {"steps": args.steps}, timeout=600)
    report.say(f"{args.ranks} gloo ranks on 127.0.0.1, {args.steps} steps each, mean per step:")
    for name, seconds in results.items():
        report.say(f"  {name:<46} {seconds * 1e3:8.3f} ms")
    mc = results["master_computes (store check-in + broadcast)"] / results["bare broadcast_object_list"]
    ra = results["run_all (store check-in + all_gather)"] / results["bare all_gather_object"]
    report.say(f"ratio master_computes / bare broadcast: {mc:.2f}x; run_all / bare all_gather: {ra:.2f}x")
    return 0
