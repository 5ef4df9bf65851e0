"""Bytes a re-sharded load reads against the bytes the target rank needs: TP=1 (DP=2) saves, TP=2 loads.

    python -m benchmarks reshard_reads --d 512

Two spawned gloo ranks save ``harness.tp_layers.TPModel`` (fused column-parallel, row-parallel and
replicated tensors, hidden size ``--d``) at TP=1, plain and xser, then load it at TP=2 through a read-counting
storage. Prints per encoding: the bytes of the model state rank 0 holds at TP=2 (needed), the bytes it read
from the model files, and the bytes saved; the ratios read/needed (1.0 is the floor) and read/saved.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from benchmarks.core.ranks import on_ranks, write_result
from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {"plain": "plain files", "xser": "xser files (every tensor in its own file)"}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--d", type=int, default=512, help="hidden size of the test model (default 512)")


def _tp_group(tp: int) -> object:
    """This rank's tensor-parallel group at TP=``tp``."""
    import torch.distributed as dist

    import nxd_ckpt as nxd
    from nxd_ckpt.parallel_state import current_topology

    nxd.initialize_model_parallel(tensor_model_parallel_size=tp)
    mine = None
    for ranks in current_topology().groups.tp:
        group = dist.new_group(sorted(ranks))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def measure(root: str, encoding: str, d: int, out: str) -> None:
    """One rank: save at TP=1, load at TP=2 through the counting storage; rank 0 writes its bytes."""
    import nxd_ckpt as nxd
    from harness.tp_layers import TPModel
    from nxd_ckpt.testing.counting import ReadCountingStorage

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
    write_result(out, {"needed": needed, "read": read, "saved": saved})


def run(args: argparse.Namespace, report: Report) -> int:
    """Each encoding asked for on two fresh ranks."""
    os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = "0"  # every xser tensor in its own file
    for encoding in args.sections or list(SECTIONS):
        with tempfile.TemporaryDirectory() as root:
            r = report.data[encoding] = on_ranks(measure, 2, {"root": root, "encoding": encoding, "d": args.d})
        report.say(f"{encoding:5s} needed {r['needed']:>10,d} B  read {r['read']:>10,d} B  saved {r['saved']:>10,d} B  "
                   f"read/needed {r['read'] / r['needed']:.4f}  read/saved {r['read'] / r['saved']:.3f}")  # fmt: skip
    return 0
