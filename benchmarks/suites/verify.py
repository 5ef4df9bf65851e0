"""What checksum verification costs: xxh3_64 throughput, and load time with verify on vs off (cold and warm).

    python -m benchmarks verify --gb 1.1 --repeat 3

Saves one ~1.1 GB checkpoint (fp32 model + AdamW-like state, plain and xser), then loads it alternately with
``verify=True`` and ``verify=False``, medians of ``--repeat``; "cold" drops the page cache first (root only).
Also times the save with the checksumming wrapper against the same save through the bare storage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch

from benchmarks.core.files import drop_caches
from benchmarks.core.report import Report

TITLE = __doc__.splitlines()[0]
SECTIONS = {"hash": "xxh3_64 and xxh64 throughput in memory", "plain": "saves and loads, plain",
            "xser": "saves and loads, xser"}  # fmt: skip


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--gb", type=float, default=1.1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--hash-mib", type=int, default=1024, help="bytes hashed by the hash section (MiB)")


def hash_throughput(nbytes: int) -> dict[str, float]:
    """GB/s of xxh3_64 and xxh64 over ``nbytes`` in memory."""
    import xxhash

    buf = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    out = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_hexdigest), ("xxh64", xxhash.xxh64_hexdigest)):
        fn(buf)  # warm
        start = time.perf_counter()
        fn(buf)
        out[name] = len(buf) / (time.perf_counter() - start) / 1e9
    return out


def make_state(total_bytes: int) -> tuple[dict, dict]:
    """16 fp32 matrices and an AdamW-like state of each, ``total_bytes`` in all."""
    n = total_bytes // 3 // 4 // 16
    model = {f"layer{i}.weight": torch.randn(max(1, n // 1024), 1024) for i in range(16)}
    optim = {
        "state": {
            i: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)} for i, t in enumerate(model.values())
        },
        "param_groups": [{"lr": 1e-3, "params": list(range(16))}],
    }
    return model, optim


@contextlib.contextmanager
def without_hashing() -> Iterator[None]:
    """Saves write straight to the storage (manifests come out empty): the baseline for the hashing cost."""
    from nxd_ckpt.format import integrity

    cls = integrity.ChecksummingStorage
    saved = cls.open_write, cls.write_bytes
    cls.open_write = lambda self, path: self.inner.open_write(path)  # type: ignore[method-assign]
    cls.write_bytes = lambda self, path, data: self.inner.write_bytes(path, data)  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.open_write, cls.write_bytes = saved  # type: ignore[method-assign]


def timed_load(ckpt: str, verify: bool, cold: bool) -> float:
    """Seconds of one load of the newest tag (cold: after dropping the page cache; nan where that is refused)."""
    import nxd_ckpt as nxd

    if cold and not drop_caches()[0]:
        return float("nan")
    model, optim = {}, {}
    start = time.perf_counter()
    nxd.load_checkpoint(ckpt, model=model, optimizer=optim, verify=verify)
    return time.perf_counter() - start


def saves(ckpt: str, model: dict, optim: dict, use_xser: bool, repeat: int) -> dict[str, list[float]]:
    """Saves with checksums and through the bare storage, alternating; their seconds."""
    import nxd_ckpt as nxd

    out: dict[str, list[float]] = {"with checksums": [], "bare storage": []}
    for i in range(repeat):
        for label in out:
            with contextlib.nullcontext() if label == "with checksums" else without_hashing():
                start = time.perf_counter()
                nxd.save_checkpoint(ckpt, f"s{i}_{label[0]}", model=model, optimizer=optim, use_xser=use_xser)
                out[label].append(time.perf_counter() - start)
    return out


def loads(report: Report, ckpt: str, repeat: int) -> None:
    """Loads with verify on and off, alternating, warm then cold."""
    for cold in (False, True):
        times: dict[bool, list[float]] = {True: [], False: []}
        timed_load(ckpt, True, False)  # warm up allocations
        for _ in range(repeat):
            for verify in (True, False):
                times[verify].append(timed_load(ckpt, verify, cold))
        on, off = statistics.median(times[True]), statistics.median(times[False])
        report.say(f"  load {'cold' if cold else 'warm'}: verify=True {on:.3f} s, verify=False {off:.3f} s, "
                   f"overhead {100 * (on - off) / off:+.0f}%")  # fmt: skip


def encoding(report: Report, work: str, model: dict, optim: dict, use_xser: bool, repeat: int) -> None:
    """One encoding's saves, loads and ``verify()``."""
    import nxd_ckpt as nxd

    ckpt = os.path.join(work, "xser" if use_xser else "plain")
    shutil.rmtree(ckpt, ignore_errors=True)
    times = saves(ckpt, model, optim, use_xser, repeat)
    nbytes = sum(t.numel() * 4 for t in model.values()) * 3
    report.say(f"{'xser' if use_xser else 'plain'}: {nbytes / 1e9:.2f} GB of tensors")
    report.say(f"  save (durable), median s: { ({k: round(statistics.median(v), 3) for k, v in times.items()}) }")
    tag = f"s{repeat - 1}_w"  # saved with checksums
    for other in os.listdir(ckpt):
        if other != tag and os.path.isdir(os.path.join(ckpt, other)):  # tags only: the tag list file stays
            shutil.rmtree(os.path.join(ckpt, other))
    loads(report, ckpt, repeat)
    result = nxd.verify(ckpt)
    report.say(f"  verify(): {result.seconds:.3f} s for {result.bytes_checked / 1e9:.2f} GB (warm)")


def run(args: argparse.Namespace, report: Report) -> int:
    """The sections asked for, in order."""
    sections = args.sections or list(SECTIONS)
    work = args.workdir or tempfile.mkdtemp(prefix="nxd_bench_verify_")
    if "hash" in sections:
        speeds = report.data["hash"] = hash_throughput(args.hash_mib << 20)
        report.say(f"hash throughput (GB/s, in memory): { ({k: round(v, 2) for k, v in speeds.items()}) }")
    model, optim = make_state(int(args.gb * 1e9))
    for use_xser in [x for x in (False, True) if ("xser" if x else "plain") in sections]:
        encoding(report, work, model, optim, use_xser, args.repeat)
    shutil.rmtree(work, ignore_errors=True)
    return 0
