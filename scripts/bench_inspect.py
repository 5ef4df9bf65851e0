"""What looking inside a checkpoint costs, against loading it: manifest and one-tensor reads, plain and xser.

    python scripts/bench_inspect.py --mib 512 --tensors 256 --dir /tmp/nxd_bench_inspect

Builds a model state of ``--mib`` MiB in ``--tensors`` tensors, saves it plain and xser with nxd_ckpt, drops
the page cache where allowed (else the numbers are warm-cache), and prints per encoding: the time to build
the manifest and the bytes it read, the time to read one tensor, and a full ``torch.load``/``load_checkpoint``
of the same file for comparison.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time

import torch

import nxd_ckpt as nxd
from nxd_ckpt.cli.progress import ReadProgressStorage
from nxd_ckpt.inspection import open_checkpoint
from nxd_ckpt.storage import LocalStorage


class Counter:
    def __init__(self) -> None:
        self.bytes_read = 0

    def __call__(self, n: int) -> None:
        self.bytes_read += n


def drop_caches() -> bool:
    """Drop the page cache (root on Linux) so reads come from the disk; False if not permitted."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="model state size in MiB")
    parser.add_argument("--tensors", type=int, default=256, help="number of tensors")
    parser.add_argument("--dir", default="/tmp/nxd_bench_inspect", help="scratch directory (deleted first)")
    args = parser.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    numel = args.mib * (1 << 20) // 4 // args.tensors
    state = {f"layers.{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    nbytes = sum(t.nbytes for t in state.values())
    nxd.save_checkpoint(args.dir, "plain", model=state)
    nxd.save_checkpoint(args.dir, "xser", model=state, use_xser=True)
    del state
    target = f"model/tp00_pp00/layers.{args.tensors // 2}.weight"
    print(f"state: {nbytes / 2**20:.0f} MiB in {args.tensors} tensors; page cache dropped: {drop_caches()}")
    for tag in ("plain", "xser"):
        drop_caches()
        counter = Counter()
        ckpt = open_checkpoint(ReadProgressStorage(LocalStorage(args.dir), counter), tag)
        objects, t_manifest = timed(ckpt.objects)
        print(
            f"{tag:5s}  manifest of {len(objects)} objects: {t_manifest * 1e3:7.1f} ms, "
            f"{counter.bytes_read / 1024:.0f} KiB read"
        )
        drop_caches()
        counter.bytes_read = 0
        tensor, t_one = timed(lambda ckpt=ckpt: ckpt.read(target))
        print(
            f"{tag:5s}  read one tensor ({tensor.nbytes / 2**20:.1f} MiB):  {t_one * 1e3:7.1f} ms, "
            f"{counter.bytes_read / 1024:.0f} KiB read"
        )
        drop_caches()
        model: dict = {}
        _, t_full = timed(lambda tag=tag, model=model: nxd.load_checkpoint(args.dir, tag, model=model, verify=False))
        print(f"{tag:5s}  full load_checkpoint:           {t_full * 1e3:7.1f} ms")
    shutil.rmtree(args.dir, ignore_errors=True)
    nxd.finalize_checkpoint()


if __name__ == "__main__":
    main()
