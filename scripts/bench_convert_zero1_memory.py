#!/usr/bin/env python3
"""Peak memory of the offline ZeRO-1 converter on a state much larger than one parameter.

Writes a synthetic ZeRO-1 checkpoint (TP=1, DP=4; ``--params`` parameters of ``--rows`` x ``--cols`` fp32, each
with exp_avg, exp_avg_sq and a master weight), then runs each conversion in a fresh subprocess and reports that
process's peak resident memory (``VmHWM``; ``ru_maxrss`` would include the parent's at fork) above its resident
memory right after the imports, next to the same conversion done the way NxD's tool does it (load every shard,
merge, split, save).

    python scripts/bench_convert_zero1_memory.py --workdir /tmp/z1bench --params 12 --rows 2048 --cols 4096
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

_CHILD = r"""
import json, sys, time
import torch
import nxd_ckpt.tools.convert_zero1 as tool
from nxd_ckpt.load import zero1

def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0

mode, src, dst, dp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
base = status_mb("VmRSS")
start = time.perf_counter()
if mode == "nxd_style":  # what NxD's converter does: every shard loaded, merged in memory, split, saved
    import os
    shards = [torch.load(f"{src}/optim/dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", weights_only=True) for d in range(4)]
    merged = zero1.merge_states(shards)
    del shards
    os.makedirs(f"{dst}/optim", exist_ok=True)
    for r in range(dp):
        torch.save(zero1.shard_state(merged, dp, r), f"{dst}/optim/dp_rank_{r:02d}_tp_rank_00_pp_rank_00.pt")
else:
    kwargs = {"convert_to_full": True} if dp == 0 else {"dp_size": dp}
    tool.convert_zero1(src, dst, progress=False, **kwargs)
seconds = time.perf_counter() - start
peak = status_mb("VmHWM")  # this process's own high-water mark (ru_maxrss also counts the forking parent)
print(json.dumps({"baseline_mb": base, "peak_mb": peak, "seconds": seconds}))
"""


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
        shard = {
            "state": {},
            "param_groups": [{"lr": 1e-3, "params": list(shapes)}],
            "base_state": {},
            "shape_info": {i: torch.Size(s) for i, s in shapes.items()},
            "sharded_master_weights": {},
        }
        for i, s in shapes.items():
            shp = zero1.shard_shape(s, 4)
            shard["base_state"][i] = {
                "step": torch.tensor(10.0),
                "exp_avg": torch.randn(shp, generator=g),
                "exp_avg_sq": torch.rand(shp, generator=g),
            }
            shard["sharded_master_weights"][i] = torch.randn(shp, generator=g)
        statefile.write_state_file(storage, layout.optim_file(tag, d, 0, 0), shard, xser_encoding=use_xser)
        del shard
    storage.write_bytes(layout.tag_path(tag, layout.DONE_MARKER), b"1")
    per_param = [3 * r * c * 4 for r, c in shapes.values()]
    return sum(per_param), max(per_param)


def run_child(mode: str, src: str, dst: str, dp: int) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, src, dst, str(dp)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/nxd_zero1_bench")
    parser.add_argument("--params", type=int, default=12)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = parser.parse_args()
    results = []
    for use_xser in (False, True):
        enc = "xser" if use_xser else "plain"
        work = os.path.join(args.workdir, enc)
        shutil.rmtree(work, ignore_errors=True)
        src = os.path.join(work, "in", "step_1")
        t0 = time.perf_counter()
        total, largest = make_input(src, args.params, args.rows, args.cols, use_xser)
        print(
            f"[{enc}] input: {total / 2**20:.0f} MiB of optimizer state in 4 shards, largest parameter's full "
            f"state {largest / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        cases = [("stream", 2, "DP 4 -> 2"), ("stream", 3, "DP 4 -> 3"), ("stream", 0, "DP 4 -> full")]
        if not use_xser:
            cases.append(("nxd_style", 2, "DP 4 -> 2, NxD-style (load all, merge, split)"))
        for mode, dp, label in cases:
            r = run_child(mode, src, os.path.join(work, f"out_{mode}_{dp}", "step_1"), dp)
            extra = r["peak_mb"] - r["baseline_mb"]
            line = {
                "encoding": enc,
                "case": label,
                "state_mib": round(total / 2**20),
                "largest_param_state_mib": round(largest / 2**20),
                "peak_above_baseline_mib": round(extra),
                "peak_rss_mib": round(r["peak_mb"]),
                "seconds": round(r["seconds"], 2),
            }
            results.append(line)
            print(json.dumps(line), flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| encoding | conversion | state (MiB) | largest param state (MiB) | peak above imports (MiB) | s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['encoding']} | {r['case']} | {r['state_mib']} | {r['largest_param_state_mib']} | "
            f"{r['peak_above_baseline_mib']} | {r['seconds']} |"
        )


if __name__ == "__main__":
    main()
