"""What checksum verification costs: xxh3_64 throughput, and load time with verify on vs off (cold and warm).

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
import subprocess
import tempfile
import time
from collections.abc import Iterator

import torch
import xxhash

import nxd_ckpt as nxd
from nxd_ckpt.format import integrity


def hash_throughput(nbytes: int) -> dict[str, float]:
    buf = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    out = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_hexdigest), ("xxh64", xxhash.xxh64_hexdigest)):
        fn(buf)  # warm
        start = time.perf_counter()
        fn(buf)
        out[name] = len(buf) / (time.perf_counter() - start) / 1e9
    return out


def make_state(total_bytes: int) -> tuple[dict, dict]:
    n = total_bytes // 3 // 4 // 16
    model = {f"layer{i}.weight": torch.randn(n // 1024, 1024) for i in range(16)}
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
    cls = integrity.ChecksummingStorage
    saved = cls.open_write, cls.write_bytes
    cls.open_write = lambda self, path: self.inner.open_write(path)  # type: ignore[method-assign]
    cls.write_bytes = lambda self, path, data: self.inner.write_bytes(path, data)  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.open_write, cls.write_bytes = saved  # type: ignore[method-assign]


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed_load(ckpt: str, verify: bool, cold: bool) -> float:
    if cold and not drop_caches():
        return float("nan")
    model, optim = {}, {}
    start = time.perf_counter()
    nxd.load_checkpoint(ckpt, model=model, optimizer=optim, verify=verify)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="nxd_bench_verify_")
    print("hash throughput (GB/s, in memory):", {k: round(v, 2) for k, v in hash_throughput(1 << 30).items()})
    model, optim = make_state(int(args.gb * 1e9))
    nbytes = sum(t.numel() * 4 for t in model.values()) * 3
    for use_xser in (False, True):
        ckpt = os.path.join(work, "xser" if use_xser else "plain")
        shutil.rmtree(ckpt, ignore_errors=True)
        saves = {"with checksums": [], "bare storage": []}
        for i in range(args.repeat):
            for label in saves:
                with contextlib.nullcontext() if label == "with checksums" else without_hashing():
                    start = time.perf_counter()
                    nxd.save_checkpoint(ckpt, f"s{i}_{label[0]}", model=model, optimizer=optim, use_xser=use_xser)
                    saves[label].append(time.perf_counter() - start)
        print(f"\n{'xser' if use_xser else 'plain'}: {nbytes / 1e9:.2f} GB of tensors")
        print("  save (durable), median s:", {k: round(statistics.median(v), 3) for k, v in saves.items()})
        tag = f"s{args.repeat - 1}_w"  # saved with checksums
        keep = os.path.join(ckpt, tag)
        for other in os.listdir(ckpt):
            if other != tag:
                shutil.rmtree(os.path.join(ckpt, other))
        assert os.path.isdir(keep)
        for cold in (False, True):
            times: dict[bool, list[float]] = {True: [], False: []}
            timed_load(ckpt, True, False)  # warm up allocations
            for _ in range(args.repeat):
                for verify in (True, False):
                    times[verify].append(timed_load(ckpt, verify, cold))
            on, off = statistics.median(times[True]), statistics.median(times[False])
            print(
                f"  load {'cold' if cold else 'warm'}: verify=True {on:.3f} s, verify=False {off:.3f} s, "
                f"overhead {100 * (on - off) / off:+.0f}%"
            )
        report = nxd.verify(ckpt)
        print(f"  verify(): {report.seconds:.3f} s for {report.bytes_checked / 1e9:.2f} GB (warm)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
