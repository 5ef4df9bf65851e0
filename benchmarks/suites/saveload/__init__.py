"""Save/load throughput of nxd_ckpt against the disk and the alternatives users would pick, host memory per path,
the first async save and memory-tier restores, in one run and interleaved.

    PY=$(bash scripts/setup_env.sh cpu | tail -1)
    $PY -m benchmarks saveload --size-gb 2 --ranks 2 --reps 3
    PJRT_DEVICE=CPU $(bash scripts/setup_env.sh xla | tail -1) -m benchmarks saveload ...   # adds the XLA rows

State: a transformer-like fp32 model replicated on every rank (DP = --ranks) plus AdamW ``exp_avg``/``exp_avg_sq``
split ZeRO-1 style; model + all optimizer shards = --size-gb. Throughput is that total divided by the time from a
barrier before the step to a barrier after it (so: the slowest rank). Saves are timed to durability (every file
fsynced); the page cache is dropped before every load (cold reads; needs root, otherwise the table says "warm").
A load ends with every rank holding the model and its own optimizer shard. Sections run interleaved (rotated
order each repetition); the table shows medians and ratios to the raw disk rows measured in the same run.

Sections are functions registered with ``@section`` (``bench.py``) in the modules ``disk``, ``peers``, ``nxd``,
``xla``, ``memory``, ``tier`` and ``s3``; each returns the save and load seconds. With ``nxd_memory`` the run
starts with the process's first async save (``benchmarks.measure.first_save``).
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.core.ranks import on_ranks
from benchmarks.core.report import Report
from benchmarks.suites.saveload import disk, memory, nxd, peers, s3, tier, xla  # noqa: F401 - register sections
from benchmarks.suites.saveload import report as saveload_report
from benchmarks.suites.saveload.bench import REGISTRY
from benchmarks.suites.saveload.worker import worker

TITLE = __doc__.splitlines()[0]
ORDER = ("raw_dd", "raw_buffered", "torch_save", "dcp", "dcp_async", "nxd_async", "nxd_xser", "nxd_xser_noverify",
         "nxd_plain", "torch_xla_xser", "nxd_xser_from_xla", "torch_load_live", "nxd_xser_live", "nxd_xser_fresh",
         "torch_xla_xser_live", "nxd_xser_live_xla", "nxd_save_keep", "nxd_save_nokeep", "s3_loopback",
         "nxd_plain_verified", "nxd_plain_live", "nxd_memory", "nxd_tier")  # fmt: skip
"""The sections' run order (the default of --sections, and the report's)."""
assert set(ORDER) == set(REGISTRY), "every registered section has its place in ORDER"
SECTIONS = {name: REGISTRY[name][0] for name in ORDER}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--size-gb", type=float, default=2.0, help="GiB of tensor data (model + optimizer shards)")
    parser.add_argument("--ranks", type=int, default=2, help="processes (DP replicas)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the synthetic layers")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    parser.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    parser.add_argument("--warmup", action="store_true", help="run every section once untimed first")


def run(args: argparse.Namespace, report: Report) -> int:
    """Spawn the ranks, run the sections, write the report."""
    options = {"size_gb": args.size_gb, "hidden": args.hidden, "sections": args.sections or list(SECTIONS),
               "reps": args.reps, "warm": args.warm, "warmup": args.warmup}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="nxd_bench_", dir=args.dir) as root:
        data = on_ranks(worker, args.ranks, {"options": options, "root": root})
    report.data.update(data)
    saveload_report.write(report, data, args.ranks, args.reps)
    return 0
