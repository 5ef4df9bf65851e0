"""Gloo ranks for the multi-rank suites: ``on_ranks`` runs a module-level function on spawned ranks (the test
harness's runner: the parent serves the store on a port it bound) and returns what rank 0 wrote; ``gather`` and
``slowest`` combine a figure across ranks."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def slowest(value: float) -> float:
    """The largest of ``value`` across the ranks (the slowest rank's time)."""
    return max(gather(value))


def write_result(out: str, result: Any) -> None:
    """Rank 0 writes a rank function's result where ``on_ranks`` reads it."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def on_ranks(
    fn: Callable[..., Any],
    world: int,
    kwargs: dict[str, Any],
    timeout: float = 1800.0,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
) -> Any:
    """Run ``fn(**kwargs, out=PATH)`` on ``world`` spawned gloo ranks and return the JSON rank 0 wrote to PATH
    (``write_result``)."""
    from harness.multiprocess import run_on_ranks

    with tempfile.TemporaryDirectory(prefix="nxd_bench_ranks_") as scratch:
        out = os.path.join(scratch, "result.json")
        run_on_ranks(fn, world, {**kwargs, "out": out}, timeout=timeout, env=env, ranks_per_node=ranks_per_node)
        if not os.path.exists(out):
            raise RuntimeError(f"{fn.__module__}.{fn.__qualname__}: rank 0 wrote no result (write_result)")
        with open(out) as f:
            return json.load(f)


def single_rank_group() -> None:
    """A 1-rank gloo group on a store this process serves on 127.0.0.1 (port 0: the kernel picks it), as a
    one-process training script has."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
