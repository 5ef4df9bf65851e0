"""Peak memory of the offline ZeRO-1 converter on a state much larger than one parameter.

Writes a synthetic ZeRO-1 checkpoint (TP=1, DP=4; ``--params`` parameters of ``--rows`` x ``--cols`` fp32, each
with exp_avg, exp_avg_sq and a master weight), then runs each conversion in a fresh process (``core.child``) and
reports that process's peak resident memory (``VmHWM``; ``ru_maxrss`` would include the parent's at fork) above its
resident memory right after the imports, next to the same conversion done the way NxD's tool does it (load every
shard, merge, split, save).

    python -m benchmarks convert_zero1_memory --workdir /tmp/z1bench --params 12 --rows 2048 --cols 4096
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time

from benchmarks.core.child import in_child
from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {"plain": "plain optimizer shards", "xser": "xser optimizer shards"}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--workdir", default="/tmp/nxd_zero1_bench")
    parser.add_argument("--params", type=int, default=12)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")


def convert_child(mode: str, src: str, dst: str, dp: int) -> dict[str, float]:
    """In a fresh process: one conversion, its peak resident memory above the resident memory after the imports."""
    import torch

    import nxd_ckpt.tools.convert_zero1 as tool
    from benchmarks.core.memory import status_bytes
    from nxd_ckpt.load import zero1

    base, start = status_bytes("VmRSS:") / 2**20, time.perf_counter()
    if mode == "nxd_style":  # what NxD's converter does: every shard loaded, merged in memory, split, saved
        name = "optim/dp_rank_{:02d}_tp_rank_00_pp_rank_00.pt"
        shards = [torch.load(os.path.join(src, name.format(d)), weights_only=True) for d in range(4)]
        merged = zero1.merge_states(shards)
        del shards
        os.makedirs(os.path.join(dst, "optim"), exist_ok=True)
        for r in range(dp):
            torch.save(zero1.shard_state(merged, dp, r), os.path.join(dst, name.format(r)))
    else:
        tool.convert_zero1(src, dst, progress=False, **({"convert_to_full": True} if dp == 0 else {"dp_size": dp}))
    seconds = time.perf_counter() - start
    return {"baseline_mb": base, "peak_mb": status_bytes("VmHWM:") / 2**20, "seconds": seconds}


def make_input(tag_dir: str, params: int, rows: int, cols: int, use_xser: bool) -> tuple[int, int]:
    """Write the DP=4 shards; return (total optimizer bytes, largest parameter's full optimizer bytes)."""
    import torch

    from nxd_ckpt import statefile
    from nxd_ckpt.format import layout
    from nxd_ckpt.load import zero1
    from nxd_ckpt.storage import LocalStorage

    root, tag = os.path.split(tag_dir)
    storage = LocalStorage(root)
    g = torch.Generator().manual_seed(0)
    shapes = {i: (rows + 3 * i, cols) for i in range(params)}  # odd row counts: padding on every DP size
    for d in range(4):
        shard = {"state": {}, "param_groups": [{"lr": 1e-3, "params": list(shapes)}], "base_state": {},
                 "shape_info": {i: torch.Size(s) for i, s in shapes.items()}, "sharded_master_weights": {}}  # fmt: skip
        for i, s in shapes.items():
            shp = zero1.shard_shape(s, 4)
            shard["base_state"][i] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(shp, generator=g),
                                      "exp_avg_sq": torch.rand(shp, generator=g)}  # fmt: skip
            shard["sharded_master_weights"][i] = torch.randn(shp, generator=g)
        statefile.write_state_file(storage, layout.optim_file(tag, d, 0, 0), shard, xser_encoding=use_xser)
        del shard
    storage.write_bytes(layout.tag_path(tag, layout.DONE_MARKER), b"1")
    per_param = [3 * r * c * 4 for r, c in shapes.values()]
    return sum(per_param), max(per_param)


def encoding(report: Report, args: argparse.Namespace, enc: str) -> list[dict]:
    """One encoding's input, then every conversion (and NxD's way, plain only)."""
    work = os.path.join(args.workdir, enc)
    shutil.rmtree(work, ignore_errors=True)
    src, t0 = os.path.join(work, "in", "step_1"), time.perf_counter()
    total, largest = make_input(src, args.params, args.rows, args.cols, enc == "xser")
    report.say(f"[{enc}] input: {total / 2**20:.0f} MiB of optimizer state in 4 shards, largest parameter's full "
               f"state {largest / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.1f} s)", err=True)  # fmt: skip
    cases = [("stream", 2, "DP 4 -> 2"), ("stream", 3, "DP 4 -> 3"), ("stream", 0, "DP 4 -> full")]
    if enc == "plain":
        cases.append(("nxd_style", 2, "DP 4 -> 2, NxD-style (load all, merge, split)"))
    results = []
    for mode, dp, label in cases:
        dst = os.path.join(work, f"out_{mode}_{dp}", "step_1")
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=False)
        r = in_child("benchmarks.suites.convert_zero1_memory:convert_child",
                     {"mode": mode, "src": src, "dst": dst, "dp": dp})  # fmt: skip
        results.append({"encoding": enc, "case": label, "state_mib": round(total / 2**20),
                        "largest_param_state_mib": round(largest / 2**20),
                        "peak_above_baseline_mib": round(r["peak_mb"] - r["baseline_mb"]),
                        "peak_rss_mib": round(r["peak_mb"]), "seconds": round(r["seconds"], 2)})  # fmt: skip
        report.say(str(results[-1]), err=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


def run(args: argparse.Namespace, report: Report) -> int:
    """Each encoding asked for, then the table."""
    results = [r for enc in args.sections or list(SECTIONS) for r in encoding(report, args, enc)]
    report.data["rows"] = results
    keys = ("encoding", "case", "state_mib", "largest_param_state_mib", "peak_above_baseline_mib", "seconds")
    report.table(["encoding", "conversion", "state (MiB)", "largest param state (MiB)", "peak above imports (MiB)",
                  "s"], [[r[k] for k in keys] for r in results], align="ll")  # fmt: skip
    return 0
