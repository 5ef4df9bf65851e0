"""Scale benchmark: what one save, async save, load and ``latest`` cost per rank at 16 to 4,096 ranks.

Ranks run as threads of this process (``testing.threadworld.ThreadWorld``: collectives at a condition variable,
the c10d store a real TCPStore on 127.0.0.1, one connection per rank), each with its own ``CheckpointManager``, a
Llama-70B-like layout (TP=32, PP=8, DP=N/256 at N >= 256; smaller worlds shrink PP, then TP) and a state of tiny
tensors with the names and count of a 70B stage (``--layers`` transformer layers split over PP; ZeRO-1 optimizer
shards on every rank), sized so that, as at 70B, norm weights stay inside the xser reference files and every
matrix gets a file of its own (one object per tensor: NxD's layout). Storage is a directory on tmpfs seen through
``testing.counting.RequestCountingStorage``, which counts the S3 requests each call would make, by kind and by
key prefix.

Reported per operation and world size (a row each):
- store operations per rank (mean and max; "wait" = blocking waits on the rank's own connection);
- collectives per rank and bytes a rank receives (as gloo would carry the pickled objects);
- coordination wall time: for each cross-rank step, from the moment the last rank arrived until the last rank
  left it, summed over the steps (and the commit), so the time the simulated ranks spend on their own work
  (serialisation, on a shared GIL) is not counted;
- files, bytes and S3 requests (PUT/GET/HEAD/LIST/POST/DELETE), the busiest key prefix, and the time those
  requests take at S3's per-prefix rates (3,500 PUT/POST/DELETE, 5,500 GET/HEAD per second per partitioned
  prefix), for the busiest prefix and for the whole tag under one prefix (a new bucket, not yet partitioned).

``--processes P`` also runs the save on P real gloo processes (``testing.multiprocess``) to check the store
figures against real torch.distributed.

    python -m benchmarks scale --quick              # 16..256 ranks: a smoke run (minutes)
    python -m benchmarks scale --json scale.json    # 16..4,096 ranks, 8 layers (one per PP stage at >= 256
                                                    # ranks): the rows of docs/scale.md (an idle machine)
    python -m benchmarks scale --ranks 1024 --layers 80   # 70B's file count per rank (long: files dominate)

Sections are the operations (``--sections save,async,load,latest,dcp``; the first save always runs with any of the
first four). ``dcp``: a ``nxd_ckpt.dcp`` save's commit and its load's planning at each world size (``dcp.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.core.report import Report
from benchmarks.suites.scale.dcp import dcp_rows, print_dcp
from benchmarks.suites.scale.output import print_header, print_requests
from benchmarks.suites.scale.processes import run_processes
from benchmarks.suites.scale.store import store_release_s
from benchmarks.suites.scale.workload import inline_bytes
from benchmarks.suites.scale.world import run_world

TITLE = __doc__.splitlines()[0]
SECTIONS = {"save": "a sync save (after the first save, which always runs)", "async": "an async save (after an "
            "untimed first one)", "load": "a load of the newest tag", "latest": "finding the newest tag",
            "dcp": "a nxd_ckpt.dcp save's commit and its load's planning (coordinator)"}  # fmt: skip


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=8, help="transformer layers of the model (70B: 80; 8 = one per "
                        "PP stage)")  # fmt: skip
    parser.add_argument("--elems", type=int, default=16, help="elements of every (tiny) tensor")
    parser.add_argument("--num-workers", type=int, default=8, help="ranks of a node writing at once (NxD's)")
    parser.add_argument("--quick", action="store_true", help="16..256 ranks, 8 layers: a smoke run")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--processes", type=int, nargs="*", default=[], help="also save on this many gloo ranks")


@contextmanager
def simulation(elems: int) -> Iterator[None]:
    """The process set up for thousands of rank threads, and put back after: the open-file limit raised (a
    waiting connection per rank thread), the simulation's knobs, and a long GIL switch interval."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("NXD_CKPT_LOG_LEVEL", "WARNING")
    os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = str(inline_bytes(elems))
    # Each rank writes its tiny files on its own thread: a real rank's I/O pool overlaps large files, which these
    # are not, and 4 pool threads per rank would put 4 x N threads of one process on the GIL at once.
    os.environ.setdefault("NXD_CKPT_IO_THREADS", "1")
    # Thousands of rank threads share one GIL: each thread waiting for it wakes at every switch interval, so at
    # CPython's 5 ms a wave of 1,024 writing ranks spent its cores handing the GIL around. Threads still hand it
    # over at every blocking call (every store wait, file write), so the ranks' order of work is unchanged.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sys.setswitchinterval(switch_interval)


def worlds(args: argparse.Namespace, ops: list[str], root: str) -> list[dict[str, Any]]:
    """Every world size's rows, each printed as it is measured."""
    rows: list[dict[str, Any]] = []
    nxd_ops = [op for op in ops if op != "dcp"]
    for n in args.ranks:
        start = time.perf_counter()
        if nxd_ops:
            release = store_release_s(n)
            print(f"  {n} ranks: the store releases {n} waiters in {release * 1e3:.1f} ms", file=sys.stderr)
            rows += run_world(n, args.layers, args.elems, nxd_ops, root, args.num_workers, release)
        if "dcp" in ops:
            for row in dcp_rows(n, root):
                print_dcp(row)
                rows.append(row)
        print(f"  {n} ranks done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows


def run(args: argparse.Namespace, report: Report) -> int:
    """Every world size, then the gloo processes asked for; the rows as JSON."""
    if args.quick:
        args.ranks = [n for n in args.ranks if n <= 256] or [16, 64]
        args.layers = min(args.layers, 8)
    ops = args.sections or list(SECTIONS)
    load1, load5, _ = os.getloadavg()
    report.say(f"load average before: {load1:.2f} {load5:.2f}; {os.cpu_count()} CPUs; layers={args.layers}")
    print_header()
    root = tempfile.mkdtemp(prefix="nxd_bench_scale_", dir=args.dir)
    try:
        with simulation(args.elems):
            rows = worlds(args, ops, root)
            processes = [run_processes(n, args.layers, args.elems, root) for n in args.processes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_requests([row for row in rows if "busiest_prefix" in row])  # the DCP rows printed theirs
    for p in processes:
        report.say(
            f"{p['ranks']} gloo processes: store operations per rank {p['store_ops_mean']:.1f} mean, "
            f"{p['store_ops_max']} max ({p['store_wait_ops_max']} waits), save {p['save_s_max']:.2f} s"
        )
    load1, load5, _ = os.getloadavg()
    report.say(f"load average after: {load1:.2f} {load5:.2f}")
    report.data.update({"rows": rows, "processes": processes, "layers": args.layers, "loadavg": os.getloadavg()})
    return 0
