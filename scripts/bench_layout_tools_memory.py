#!/usr/bin/env python3
"""Peak memory of the offline layout tools (export, reshard, import) against the largest tensor's bytes.

Writes a synthetic TP=2 PP=2 tag (plain or xser model files with a sharding record in nxd_ckpt.json, committed
like a save) of ``--layers`` layers, each a fused column-parallel (stride 3) weight, a row-parallel weight and a
replicated norm, plus one larger embedding; then runs each tool in a fresh subprocess and reports that process's
peak resident memory (``VmHWM``) above its resident memory after the imports, divided by the largest tensor's
bytes. The target is a ratio of about 2 or less: the tools hold one whole tensor and its parts, never a file.
Each tool runs twice: as the ``nxd-ckpt`` commands run it (large blocks mmap-ed, ``tools/memory.py``) and as a
library call in a process with glibc's default allocator settings.

    python scripts/bench_layout_tools_memory.py --workdir /tmp/layoutbench --layers 6 --hidden 2048
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
import nxd_ckpt as nxd

def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0

import torch
import torch.distributed.checkpoint  # imported before the baseline: code, not data
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from nxd_ckpt.tools import export, importer, reshard, model_writer, dcp_io, memory
if sys.argv[5] == "cli":  # what the nxd-ckpt commands do in their own process (tools/memory.py)
    memory.return_large_blocks_to_the_system()
case, src_dir, tag, out = sys.argv[1:5]
base = status_mb("VmRSS")
start = time.perf_counter()
if case == "export-safetensors":
    export.export(nxd.open_checkpoint(src_dir, tag), out, max_shard_bytes=1 << 30)
elif case == "export-dcp":
    export.export(nxd.open_checkpoint(src_dir, tag), out, format="dcp")
elif case.startswith("reshard-"):
    tp, pp = (int(x) for x in case.split("-")[1:])
    reshard.reshard(nxd.open_checkpoint(src_dir, tag), out, tp=tp, pp=pp)
elif case == "import-tp2":
    importer.import_weights(src_dir, out, "imported", tp=2, sharding={"*.qkv.weight": (0, 3), "*.out.weight": 1,
                            "embed.weight": 0, "*": None})
print(json.dumps({"baseline_mb": base, "peak_mb": status_mb("VmHWM"), "seconds": time.perf_counter() - start}))
"""


def make_input(root: str, tag: str, layers: int, hidden: int, use_xser: bool) -> tuple[int, int]:
    """Write the TP=2 PP=2 tag; return (total model bytes, largest tensor bytes)."""
    import torch

    from nxd_ckpt import statefile
    from nxd_ckpt.format import layout
    from nxd_ckpt.format import sharding as shd
    from nxd_ckpt.format.metadata import TagMetadata
    from nxd_ckpt.tools import offline_tag

    full: dict[str, tuple[tuple[int, ...], int | None, int, int]] = {"embed.weight": ((4 * hidden, hidden), 0, 1, 0)}
    for i in range(layers):
        stage = 0 if i < layers // 2 else 1
        full[f"layers.{i}.qkv.weight"] = ((3 * hidden, hidden), 0, 3, stage)
        full[f"layers.{i}.out.weight"] = ((hidden, hidden), 1, 1, stage)
        full[f"layers.{i}.norm.weight"] = ((hidden,), None, 1, stage)
    record = shd.ShardingRecord(
        {
            n: shd.TensorSharding(s, d, st if d is not None else 1, 2 if d is not None else 1, p)
            for n, (s, d, st, p) in full.items()
        }
    )
    storage = offline_tag.begin(root, tag)
    for pp in range(2):
        names = [n for n, (_, _, _, stage) in full.items() if stage == pp]
        for tp in range(2):
            state = {}
            for k, name in enumerate(names):  # every rank's part of the same whole tensor (seeded by name)
                whole = torch.randn(full[name][0], generator=torch.Generator().manual_seed(1000 * pp + k))
                state[name] = shd.split(whole, record.require(name), 2, tp)
                del whole
            statefile.write_state_file(storage, layout.model_file(tag, tp, pp), state, xser_encoding=use_xser)
            del state
    meta = TagMetadata(tag=tag, created_at=time.time(), tp=2, pp=2, dp=1, world_size=4, xser=use_xser,
                       items=("model",), torch_version=torch.__version__, sharding=record)  # fmt: skip
    offline_tag.commit(storage, meta)
    sizes = [record.require(n).local_shape(1) for n in full]
    nbytes = [4 * int(torch.Size(s).numel()) for s in sizes]
    return sum(nbytes), max(nbytes)


def run_child(case: str, src: str, tag: str, out: str, alloc: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    proc = subprocess.run([sys.executable, "-c", _CHILD, case, src, tag, out, alloc], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/nxd_layout_bench")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = parser.parse_args()
    results = []
    for use_xser in (False, True):
        enc = "xser" if use_xser else "plain"
        work = os.path.join(args.workdir, enc)
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.perf_counter()
        total, largest = make_input(os.path.join(work, "in"), "step_1", args.layers, args.hidden, use_xser)
        print(
            f"[{enc}] input: TP=2 PP=2, {total / 2**20:.0f} MiB of model state, largest tensor "
            f"{largest / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        src = os.path.join(work, "in")
        cases = [
            ("export-safetensors", src, "step_1", os.path.join(work, "hf")),
            ("export-dcp", src, "step_1", os.path.join(work, "dcp")),
            ("reshard-1-1", src, "step_1", os.path.join(work, "tp1")),
            ("reshard-4-2", src, "step_1", os.path.join(work, "tp4")),
        ]
        if not use_xser:
            cases.append(("import-tp2", os.path.join(work, "hf"), "-", os.path.join(work, "imported")))
        for (case, s, tag, out), alloc in [(c, a) for c in cases for a in ("cli", "default")]:
            r = run_child(case, s, tag, out, alloc)
            extra = r["peak_mb"] - r["baseline_mb"]
            line = {
                "encoding": enc,
                "case": case,
                "allocator": "large blocks mmap-ed (nxd-ckpt)" if alloc == "cli" else "glibc default (library call)",
                "state_mib": round(total / 2**20),
                "largest_tensor_mib": round(largest / 2**20, 1),
                "peak_above_baseline_mib": round(extra, 1),
                "ratio_to_largest": round(extra * 2**20 / largest, 2),
                "seconds": round(r["seconds"], 2),
            }
            results.append(line)
            print(json.dumps(line), flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        "\n| encoding | tool | allocator | state (MiB) | largest tensor (MiB) | peak above imports (MiB) | ratio | s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['encoding']} | {r['case']} | {r['allocator']} | {r['state_mib']} | {r['largest_tensor_mib']} | "
            f"{r['peak_above_baseline_mib']} | {r['ratio_to_largest']} | {r['seconds']} |"
        )


if __name__ == "__main__":
    main()
