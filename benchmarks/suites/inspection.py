"""What looking inside a checkpoint costs, against loading it: manifest and one-tensor reads, plain and xser.

    python -m benchmarks inspect --mib 512 --tensors 256 --dir /tmp/nxd_bench_inspect

Builds a model state of ``--mib`` MiB in ``--tensors`` tensors, saves it plain and xser with nxd_ckpt, drops
the page cache where allowed (else the numbers are warm-cache), and prints per encoding: the time to build
the manifest and the bytes it read, the time to read one tensor, and a full ``load_checkpoint`` of the same
tag for comparison.
"""

from __future__ import annotations

import argparse
import shutil

from benchmarks.core.files import drop_caches
from benchmarks.core.report import Report
from benchmarks.core.state import named_tensors
from benchmarks.core.timing import timed

TITLE = __doc__.splitlines()[0]
SECTIONS = {"plain": "the plain tag", "xser": "the xser tag"}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--mib", type=int, default=512, help="model state size in MiB")
    parser.add_argument("--tensors", type=int, default=256, help="number of tensors")
    parser.add_argument("--dir", default="/tmp/nxd_bench_inspect", help="scratch directory (deleted first)")


class Counter:
    """Counts the bytes a progress-reporting storage read."""

    def __init__(self) -> None:
        self.bytes_read = 0

    def __call__(self, n: int) -> None:
        self.bytes_read += n


def inspect_tag(report: Report, directory: str, tag: str, target: str) -> dict[str, float]:
    """The manifest, one tensor and a full load of ``tag``, each after dropping the page cache."""
    import nxd_ckpt as nxd
    from nxd_ckpt.cli.progress import ReadProgressStorage
    from nxd_ckpt.inspection import open_checkpoint
    from nxd_ckpt.storage import LocalStorage

    drop_caches()
    counter = Counter()
    ckpt = open_checkpoint(ReadProgressStorage(LocalStorage(directory), counter), tag)
    objects, t_manifest = timed(ckpt.objects)
    report.say(f"{tag:5s}  manifest of {len(objects)} objects: {t_manifest * 1e3:7.1f} ms, "
               f"{counter.bytes_read / 1024:.0f} KiB read")  # fmt: skip
    drop_caches()
    counter.bytes_read = 0
    tensor, t_one = timed(lambda: ckpt.read(target))
    report.say(f"{tag:5s}  read one tensor ({tensor.nbytes / 2**20:.1f} MiB):  {t_one * 1e3:7.1f} ms, "
               f"{counter.bytes_read / 1024:.0f} KiB read")  # fmt: skip
    drop_caches()
    _, t_full = timed(lambda: nxd.load_checkpoint(directory, tag, model={}, verify=False))
    report.say(f"{tag:5s}  full load_checkpoint:           {t_full * 1e3:7.1f} ms")
    return {"manifest_s": t_manifest, "one_tensor_s": t_one, "full_load_s": t_full}


def run(args: argparse.Namespace, report: Report) -> int:
    """Save both tags, then inspect each asked for."""
    import nxd_ckpt as nxd

    shutil.rmtree(args.dir, ignore_errors=True)
    state = named_tensors(args.mib << 20, args.tensors)
    nbytes = sum(t.nbytes for t in state.values())
    nxd.save_checkpoint(args.dir, "plain", model=state)
    nxd.save_checkpoint(args.dir, "xser", model=state, use_xser=True)
    del state
    report.say(f"state: {nbytes / 2**20:.0f} MiB in {args.tensors} tensors; page cache dropped: {drop_caches()[0]}")
    target = f"model/tp00_pp00/layers.{args.tensors // 2}.weight"
    for tag in args.sections or list(SECTIONS):
        report.data[tag] = inspect_tag(report, args.dir, tag, target)
    shutil.rmtree(args.dir, ignore_errors=True)
    nxd.finalize_checkpoint()
    return 0
