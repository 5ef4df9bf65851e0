"""``s3_loopback``: every rank saves its state to ``s3://`` on a loopback moto server and loads it back. Runs
only with ``NXD_CKPT_BENCH_S3=1`` (moto runs at tens of MB/s) and boto3 + moto installed."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from benchmarks.core.s3 import S3_BUCKET, S3_TITLE, apply_loopback_s3_env, have_moto
from benchmarks.core.state import assert_same
from benchmarks.suites.saveload.bench import Bench, Timing, section

_server: list[Any] = []  # the run's MotoServer, started by rank 0 on first use


def _s3_available() -> bool:
    """The section runs only with ``NXD_CKPT_BENCH_S3=1`` (moto is slow) and boto3 + moto."""
    return os.environ.get("NXD_CKPT_BENCH_S3") == "1" and have_moto()


def _ensure_server(rank: int) -> None:
    """Rank 0 starts the loopback server once per run; every rank points the AWS environment at it."""
    import atexit

    import boto3

    from harness.s3server import MotoServer

    endpoint = [None]
    if rank == 0:
        if not _server:
            _server.append(MotoServer().start())
            atexit.register(_server[0].stop)
            apply_loopback_s3_env(_server[0].endpoint_url)
            boto3.session.Session().client("s3").create_bucket(Bucket=S3_BUCKET)
        endpoint = [_server[0].endpoint_url]
    dist.broadcast_object_list(endpoint, src=0)
    apply_loopback_s3_env(str(endpoint[0]))


@section("s3_loopback", f"{S3_TITLE}: nxd_ckpt plain to s3://, load(verify=False) (loopback, not AWS S3)",
         _s3_available)  # fmt: skip
def s3_loopback(b: Bench) -> Timing:
    """Every rank saves its state to ``s3://`` on the loopback server and loads it back (unverified)."""
    import nxd_ckpt as nxd
    from nxd_ckpt.storage.s3 import S3Storage

    _ensure_server(b.rank)
    url = f"s3://{S3_BUCKET}/bench"
    model_out: dict = {}
    optim_out: dict = {}

    def save() -> None:
        nxd.save_checkpoint(url, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True)

    def load() -> None:
        nxd.load_checkpoint(url, "step_1", model=model_out, optimizer=optim_out, verify=False)

    result = Timing(b.timed(save), b.timed(load))  # nothing to drop: moto holds objects in memory
    if b.check:
        assert_same(b.model, model_out, "s3_loopback model")
        assert_same(b.optimizer, optim_out, "s3_loopback optimizer")
    dist.barrier()
    if b.rank == 0:
        S3Storage(url).delete_tree("step_1")
    dist.barrier()
    return result
