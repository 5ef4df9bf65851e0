"""The disk's own limits, measured in the same run: ``dd`` with O_DIRECT (the physical limit) and buffered
Python writes through the page cache."""

from __future__ import annotations

import contextlib
import os
import subprocess

import torch

from benchmarks.suites.saveload.bench import Bench, Timing, section

BLOCK = 64 << 20


@section("raw_dd", "disk: dd O_DIRECT+fdatasync / cold dd read")
def raw_dd(b: Bench) -> Timing:
    """The physical limit: each rank streams its share of the bytes with dd (no page cache on the write)."""
    count = max(1, round(b.total_bytes / b.world / BLOCK))
    out = b.path(f"raw_dd_{b.rank}")

    def write() -> None:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={out}", f"bs={BLOCK}", f"count={count}", "oflag=direct", "conv=fdatasync"],
            check=True,
            stderr=subprocess.DEVNULL,
        )

    def read() -> None:
        subprocess.run(["dd", f"if={out}", "of=/dev/null", f"bs={BLOCK}"], check=True, stderr=subprocess.DEVNULL)

    scale = b.total_bytes / (count * BLOCK * b.world)  # report per total_bytes
    timing = Timing(b.timed(write) * scale, b.timed_load(read) * scale)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    return timing


@section("raw_buffered", "disk: buffered write+fsync / cold read (Python, 64 MiB blocks)")
def raw_buffered(b: Bench) -> Timing:
    """What a library can hope for through the page cache: large writes from touched memory, then fsync."""
    share = b.total_bytes // b.world
    buf = torch.ones(min(share, BLOCK), dtype=torch.uint8).numpy()
    out = b.path(f"raw_buffered_{b.rank}")

    def write() -> None:
        with open(out, "wb", buffering=0) as f:
            left = share
            while left > 0:
                left -= f.write(memoryview(buf)[: min(left, len(buf))])
            os.fsync(f.fileno())

    def read() -> None:
        with open(out, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    timing = Timing(b.timed(write), b.timed_load(read))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    return timing
