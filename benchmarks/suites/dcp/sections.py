"""The dcp suite's sections: ``cpu`` (CPU state on spawned gloo ranks), ``xla`` and ``cuda`` (state on a device,
one rank, in a fresh process: the XLA one in the XLA environment's interpreter when this one has no torch_xla).
Each returns its figures, or ``{"skipped": why}``."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from benchmarks.core.child import in_child
from benchmarks.core.ranks import on_ranks

XLA_ENV_PYTHON = os.path.expanduser("~/.cache/nxd-ckpt/envs/xla/bin/python")
GB = 10**9


def progress(line: str) -> None:
    """A progress line of rank 0 (stdout, flushed)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"dcp: {line}", flush=True)


def cpu_worker(total_bytes: int, hidden: int, reps: int, root: str, warm: bool, out: str) -> None:
    """One rank of the cpu section: a replicated model and this rank's ZeRO-1 AdamW shard saved as
    ``{"model", "optim_<rank>"}``; loads go into a touched copy of it; the baseline is a memcpy of its tensors into
    a touched buffer."""
    import torch.distributed as dist

    from benchmarks.core.baselines import aligned_views, copy_into
    from benchmarks.core.ranks import gather, write_result
    from benchmarks.core.state import assert_same, nbytes_of, tensors_of, touched_like, transformer_state
    from benchmarks.suites.dcp.paths import build_loads, build_paths
    from benchmarks.suites.dcp.rounds import Setup, measure

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = transformer_state(total_bytes, rank, world, hidden)
    state = {"model": model, f"optim_{rank}": optimizer}
    live = touched_like(state)
    tensors = tensors_of(state)
    views = aligned_views(tensors)

    def check() -> str | None:
        try:
            assert_same(state, live, "load")
        except AssertionError as e:
            return str(e)
        return None

    def scribble() -> None:
        for t in tensors_of(live):
            t.zero_()

    paths, missing = build_paths(None)
    setup = Setup(state, live, paths, build_loads(paths), lambda: copy_into(tensors, views), check, scribble,
                  lambda: None, root, warm)  # fmt: skip
    result = measure(setup, reps, progress)
    result |= {"missing": missing, "ranks": world, "total_bytes": total_bytes}
    result["bytes_per_rank"] = gather(nbytes_of(state))
    write_result(out, result)


def device_main(kind: str, total_bytes: int, reps: int, root: str, warm: bool) -> dict[str, Any]:
    """The xla or cuda section in this (fresh) process: a model of transformer blocks and its AdamW state on the
    device, made by 2 real steps, on a 1-rank gloo group; loads go into the live state dicts; the baseline is the
    device -> host copy floor (CUDA: into pinned buffers kept; XLA: one bulk transfer)."""
    from benchmarks.core.devices import Device, Training, first_difference, layout_for
    from benchmarks.core.ranks import single_rank_group
    from benchmarks.core.state import nbytes_of, tensors_of
    from benchmarks.suites.dcp.paths import build_loads, build_paths
    from benchmarks.suites.dcp.rounds import Setup, measure

    dev = Device(kind)
    single_rank_group()
    hidden, layers = layout_for(total_bytes, None)
    tr = Training(dev, hidden, layers)
    tr.steps(2)
    state, live = tr.state_dicts(), tr.state_dicts()
    reference = dev.reference(tensors_of(state))

    def check() -> str | None:
        return first_difference(reference, dev.readable(tensors_of(tr.state_dicts())))

    paths, missing = build_paths(dev)
    setup = Setup(state, live, paths, build_loads(paths), lambda: dev.pinned_copy(tensors_of(state))[0], check,
                  tr.scribble, dev.sync, root, warm)  # fmt: skip
    result = measure(setup, reps, progress)
    dev.drop_floor_buffers()
    return result | {"missing": missing, "ranks": 1, "total_bytes": total_bytes, "bytes_per_rank": [nbytes_of(state)],
                     "device": dev.name(), "versions": dev.versions(), "hidden": hidden, "layers": layers}  # fmt: skip


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The cpu section on ``--ranks`` spawned gloo ranks."""
    with tempfile.TemporaryDirectory(prefix="nxd_bench_dcp_cpu_", dir=args.dir) as root:
        kwargs = {"total_bytes": int(args.size_gb * GB), "hidden": args.hidden, "reps": args.reps, "root": root,
                  "warm": args.warm}  # fmt: skip
        return on_ranks(cpu_worker, args.ranks, kwargs)


def xla_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """The interpreter the xla section runs in (--xla-python, this one when it has torch_xla, else the XLA
    environment's), or None and why there is none."""
    from benchmarks.core.state import have_torch_xla

    if args.xla_python:
        return args.xla_python, ""
    if have_torch_xla():
        return sys.executable, ""
    if os.path.exists(XLA_ENV_PYTHON):
        return XLA_ENV_PYTHON, ""
    return None, (f"torch_xla is not importable by {sys.executable} and {XLA_ENV_PYTHON} does not exist: build it "
                  "with `bash scripts/setup_env.sh xla`, or pass --xla-python")  # fmt: skip


def run_device(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """The xla or cuda section in a fresh process, or why it was skipped."""
    env: dict[str, str] = {}
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return {"skipped": f"no GPU: this torch ({torch.__version__}) sees no CUDA device"}
        python: str | None = sys.executable
    else:
        python, why = xla_python(args)
        if python is None:
            return {"skipped": why}
        env["PJRT_DEVICE"] = "CPU"
    size_gb = args.device_size_gb or (10.0 if kind == "cuda" else 0.4)
    with tempfile.TemporaryDirectory(prefix=f"nxd_bench_dcp_{kind}_", dir=args.dir) as root:
        kwargs = {"kind": kind, "total_bytes": int(size_gb * GB), "reps": args.reps, "root": root, "warm": args.warm}
        return in_child("benchmarks.suites.dcp.sections:device_main", kwargs, env=env, python=python)
