"""Bytes a re-sharded load reads against the bytes the target rank needs: TP=1 (DP=2) saves, TP=2 loads.

    python scripts/bench_reshard_reads.py --d 512

Two spawned gloo ranks save ``harness.tp_layers.TPModel`` (fused column-parallel, row-parallel and
replicated tensors, hidden size ``--d``) at TP=1, plain and xser, then load it at TP=2 through a read-counting
storage. Prints per encoding: the bytes of the model state rank 0 holds at TP=2 (needed), the bytes it read
from the model files, and the bytes saved; the ratios read/needed (1.0 is the floor) and read/saved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch.distributed as dist

import nxd_ckpt as nxd
from nxd_ckpt.parallel_state import current_topology
from nxd_ckpt.testing.counting import ReadCountingStorage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the test harness, harness/
from harness.multiprocess import run_on_ranks
from harness.tp_layers import TPModel


def _tp_group(tp: int) -> object:
    nxd.initialize_model_parallel(tensor_model_parallel_size=tp)
    mine = None
    for ranks in current_topology().groups.tp:
        group = dist.new_group(sorted(ranks))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def measure(root: str, encoding: str, d: int, out: str) -> None:
    model = TPModel(d=d, hidden=d, n_layers=2, tp_group=_tp_group(1), seed=0)
    ckpt = os.path.join(root, "ckpt")
    nxd.save_checkpoint(ckpt, "t", model=model, use_xser=encoding == "xser")
    nxd.destroy_model_parallel()
    target = TPModel(d=d, hidden=d, n_layers=2, tp_group=_tp_group(2), seed=3)
    needed = sum(t.numel() * t.element_size() for t in target.state_dict().values())
    model_dir = os.path.join(ckpt, "t", "model")
    saved = sum(os.path.getsize(os.path.join(p, f)) for p, _, files in os.walk(model_dir) for f in files)
    storage = ReadCountingStorage(ckpt)
    nxd.load_checkpoint(storage, "t", model=target, verify=False)
    read = sum(n for path, n in storage.bytes_read.items() if path.startswith("t/model/"))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"needed": needed, "read": read, "saved": saved}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=512, help="hidden size of the test model (default 512)")
    args = parser.parse_args()
    os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = "0"  # every xser tensor in its own file
    for encoding in ("plain", "xser"):
        with tempfile.TemporaryDirectory() as root:
            out = os.path.join(root, "result.json")
            run_on_ranks(measure, 2, {"root": root, "encoding": encoding, "d": args.d, "out": out})
            with open(out) as f:
                r = json.load(f)
        print(
            f"{encoding:5s} needed {r['needed']:>10,d} B  read {r['read']:>10,d} B  saved {r['saved']:>10,d} B  "
            f"read/needed {r['read'] / r['needed']:.4f}  read/saved {r['read'] / r['saved']:.3f}"
        )


if __name__ == "__main__":
    main()
