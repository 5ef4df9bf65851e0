"""Checkpoint save/load throughput to s3:// on a loopback moto server, against a raw boto3 transfer.

What this measures is the loopback path through moto's standalone server (a single Python process that keeps
objects in memory), not AWS S3: the numbers bound the client-side cost of the S3 backend and show the ratio to
a plain boto3 transfer of the same bytes to the same server, which is the "physical limit" here. Each
operation runs ``--repeats`` times, interleaved (boto3 raw, nxd_ckpt save, nxd_ckpt load); medians are printed.

    python -m benchmarks s3 --size-mb 256 --repeats 3

The saveload suite has the multi-rank section ``s3_loopback`` (with ``NXD_CKPT_BENCH_S3=1``).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import uuid
from typing import Any

import torch

from benchmarks.core.report import Report
from benchmarks.core.s3 import S3_BUCKET, S3_TITLE, apply_loopback_s3_env

TITLE = __doc__.splitlines()[0]
SECTIONS = {"loopback": "raw boto3 upload/download, nxd_ckpt save/load, interleaved"}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--size-mb", type=int, default=256, help="tensor data per checkpoint (MiB)")
    parser.add_argument("--repeats", type=int, default=3)


def synthetic_model(size_mb: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of 4-64 MiB (transformer-like layer sizes) adding up to ``size_mb`` MiB."""
    torch.manual_seed(0)
    state, left, i = {}, size_mb << 20, 0
    while left > 0:
        nbytes = min(left, (4 << 20) * (1 + i % 16))
        state[f"layer_{i}.weight"] = torch.randn(nbytes // 4)
        left -= nbytes
        i += 1
    return state


def one_round(r: int, model: dict, payload: bytes, times: dict[str, list[float]], storage: Any) -> None:
    """One interleaved round: boto3 upload and download of ``payload``, nxd_ckpt save and load of ``model``."""
    import nxd_ckpt as nxd
    from nxd_ckpt.storage.s3 import S3Storage

    client, config, key = storage._client, storage._transfer_config(), f"raw/{r}.pt"
    start = time.perf_counter()
    client.upload_fileobj(io.BytesIO(payload), S3_BUCKET, key, Config=config)
    times["boto3 upload_fileobj"].append(time.perf_counter() - start)
    start = time.perf_counter()
    client.download_fileobj(S3_BUCKET, key, io.BytesIO(), Config=config)
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


def s3_loopback_section(size_mb: int = 256, repeats: int = 3) -> list[tuple[str, float, float]]:
    """Rows ``(label, median seconds, GB/s)`` for raw boto3 and nxd_ckpt save/load to a loopback moto server."""
    import boto3

    from harness.s3server import MotoServer
    from nxd_ckpt.storage.s3 import S3Storage

    model = synthetic_model(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    raw = io.BytesIO()
    torch.save(model, raw)
    payload = raw.getvalue()
    times: dict[str, list[float]] = {"boto3 upload_fileobj": [], "boto3 download_fileobj": [], "save": [], "load": []}
    with MotoServer() as server:
        apply_loopback_s3_env(server.endpoint_url)
        boto3.session.Session().client("s3").create_bucket(Bucket=S3_BUCKET)
        storage = S3Storage(f"s3://{S3_BUCKET}/raw")
        for r in range(repeats):
            one_round(r, model, payload, times, storage)
    rows = []
    for label, values in times.items():
        median = statistics.median(values)
        size = len(payload) if label.startswith("boto3") else nbytes
        name = label if label.startswith("boto3") else f"nxd_ckpt {label} (plain, 1 process)"
        rows.append((name, median, size / median / 1e9))
    return rows


def run(args: argparse.Namespace, report: Report) -> int:
    """The loopback rows, as a table."""
    rows = report.data["rows"] = s3_loopback_section(args.size_mb, args.repeats)
    report.say(f"## {S3_TITLE}: {args.size_mb} MiB of fp32 tensors, median of {args.repeats}")
    report.say("(loopback to moto, one Python process holding objects in memory: not AWS S3 throughput)")
    report.table(["operation", "median s", "GB/s"], [[label, f"{s:.2f}", f"{g:.2f}"] for label, s, g in rows])
    return 0
