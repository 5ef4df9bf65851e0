"""Benchmark section "S3 (loopback moto server)": checkpoint save/load throughput to s3:// on 127.0.0.1.

What this measures is the loopback path through moto's standalone server (a single Python process that keeps
objects in memory), not AWS S3: the numbers bound the client-side cost of the S3 backend and show the ratio to
a plain boto3 transfer of the same bytes to the same server, which is the "physical limit" here. Each
operation runs ``--repeats`` times, interleaved (boto3 raw, nxd_ckpt save, nxd_ckpt load); medians are printed.

    python scripts/bench_s3.py --size-mb 256 --repeats 3

``s3_loopback_section(size_mb, repeats)`` returns the rows. scripts/benchmark.py has the multi-rank section
``s3_loopback`` (interleaved with the disk rows; rank 0 starts one moto server per run, every rank saves/loads its
state to ``s3://`` through it). It is slow (moto runs at tens of MB/s), so it only runs when
``NXD_CKPT_BENCH_S3=1`` is set.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import uuid

import torch
from benchlib import S3_BUCKET, S3_TITLE, apply_loopback_s3_env

import nxd_ckpt as nxd
from nxd_ckpt.storage.s3 import S3Storage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the test harness, harness/
from harness.s3server import MotoServer


def _synthetic_model(size_mb: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of 4-64 MiB (transformer-like layer sizes) adding up to ``size_mb`` MiB."""
    torch.manual_seed(0)
    state, left, i = {}, size_mb << 20, 0
    while left > 0:
        nbytes = min(left, (4 << 20) * (1 + i % 16))
        state[f"layer_{i}.weight"] = torch.randn(nbytes // 4)
        left -= nbytes
        i += 1
    return state


def s3_loopback_section(size_mb: int = 256, repeats: int = 3) -> list[tuple[str, float, float]]:
    """Rows ``(label, median seconds, GB/s)`` for raw boto3 and nxd_ckpt save/load to a loopback moto server."""
    import boto3

    model = _synthetic_model(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    raw = io.BytesIO()
    torch.save(model, raw)
    payload = raw.getvalue()
    times: dict[str, list[float]] = {"boto3 upload_fileobj": [], "boto3 download_fileobj": [], "save": [], "load": []}
    with MotoServer() as server:
        apply_loopback_s3_env(server.endpoint_url)
        boto3.session.Session().client("s3").create_bucket(Bucket=S3_BUCKET)
        storage = S3Storage(f"s3://{S3_BUCKET}/raw")
        client, config = storage._client, storage._transfer_config()
        for r in range(repeats):
            key = f"raw/{r}.pt"
            start = time.perf_counter()
            client.upload_fileobj(io.BytesIO(payload), S3_BUCKET, key, Config=config)
            times["boto3 upload_fileobj"].append(time.perf_counter() - start)
            sink = io.BytesIO()
            start = time.perf_counter()
            client.download_fileobj(S3_BUCKET, key, sink, Config=config)
            times["boto3 download_fileobj"].append(time.perf_counter() - start)
            client.delete_object(Bucket=S3_BUCKET, Key=key)

            url = f"s3://{S3_BUCKET}/ckpt-{uuid.uuid4().hex[:6]}"
            start = time.perf_counter()
            nxd.save_checkpoint(url, "step_1", model=model)
            times["save"].append(time.perf_counter() - start)
            target = {k: torch.empty_like(v) for k, v in model.items()}
            start = time.perf_counter()
            nxd.load_checkpoint(url, model=target)
            times["load"].append(time.perf_counter() - start)
            assert all(torch.equal(target[k], v) for k, v in model.items())
            S3Storage(url).delete_tree("step_1")
    rows = []
    for label, values in times.items():
        median = statistics.median(values)
        size = len(payload) if label.startswith("boto3") else nbytes
        name = label if label.startswith("boto3") else f"nxd_ckpt {label} (plain, 1 process)"
        rows.append((name, median, size / median / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="tensor data per checkpoint (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = s3_loopback_section(args.size_mb, args.repeats)
    print(f"## {S3_TITLE}: {args.size_mb} MiB of fp32 tensors, median of {args.repeats}")
    print("(loopback to moto, one Python process holding objects in memory: not AWS S3 throughput)")
    print("| operation | median s | GB/s |")
    print("|---|---:|---:|")
    for label, seconds, gbps in rows:
        print(f"| {label} | {seconds:.2f} | {gbps:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
