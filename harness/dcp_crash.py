"""Fault injection for DCP saves: a single-process ``dcp.save`` SIGKILLed at its N-th filesystem mutation, through
``nxd_ckpt.dcp.StorageWriter`` or DCP's own ``FileSystemWriter``, and a judge of what a folder then loads.

The saving process is forked from the test session's forkserver (torch, DCP and nxd_ckpt already imported), so a
kill costs a fraction of a second. The state of ``version`` is a pure function of it (``dcp_state``), so a load
is checked bit-exactly against the version it claims.
"""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from harness.crashloop import _MUTATIONS, _kill_at_call, model_state
from harness.multiprocess import rank_context
from nxd_ckpt.dcp import StorageReader, StorageWriter

WRITERS = ("nxd_ckpt", "dcp")
"""``nxd_ckpt``: nxd_ckpt.dcp.StorageWriter; ``dcp``: torch's FileSystemWriter (fsyncs files, renames .metadata)."""


def dcp_state(version: int) -> dict[str, Any]:
    """The state saved as ``version``: tensors and a non-tensor value, as a training state dict has."""
    return {"model": model_state(version), "step": version}


def empty_state() -> dict[str, Any]:
    """A state dict of the right shapes for loading into (zeros; the step a placeholder)."""
    return {"model": {k: torch.zeros_like(v) for k, v in model_state(0).items()}, "step": -1}


def _writer(kind: str, path: str, threads: int) -> Any:
    if kind == "nxd_ckpt":
        return StorageWriter(path, thread_count=threads)
    return dcp.FileSystemWriter(path, thread_count=threads)


def _save_child(path: str, version: int, writer: str, threads: int, kill_after: int, log_path: str | None) -> None:
    """Save ``version`` into ``path`` (``threads`` files), SIGKILLing this process at its ``kill_after``-th
    mutation (never, if negative); exit status 100 + the mutations a finished save made."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
    calls = _kill_at_call(kill_after, _MUTATIONS, log_path, write_opens=True)
    dcp.save(dcp_state(version), storage_writer=_writer(writer, path, threads), no_dist=True)
    os._exit(100 + min(calls[0], 150))


def run_dcp_save(
    path: str, version: int, writer: str, threads: int = 1, kill_after: int = -1, log_path: str | None = None
) -> int:
    """Save ``version`` into the folder ``path`` through ``writer`` (one of ``WRITERS``, writing ``threads`` files)
    in a forked process killed at its ``kill_after``-th mutation; the mutations a finished save made, or -1 when it
    was killed."""
    ctx = rank_context(__name__)
    args = (path, version, writer, threads, kill_after, log_path)
    p = ctx.Process(target=_save_child, args=args, daemon=True)
    p.start()
    p.join(timeout=60)
    if p.exitcode == -signal.SIGKILL:
        return -1
    if p.exitcode is None or p.exitcode < 100:
        raise AssertionError(f"DCP saving process failed (exit code {p.exitcode})")
    return p.exitcode - 100


def loaded_version(path: str, verified: bool = False) -> int | None:
    """The version the folder ``path`` loads as, bit-exact, through DCP's own FileSystemReader (``verified``:
    nxd_ckpt's StorageReader); None when it does not load, or loads something that is no saved version."""
    out = empty_state()
    reader = StorageReader(path) if verified else dcp.FileSystemReader(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
        return None
    version = out["step"]
    if not isinstance(version, int) or version < 0:
        return None
    expected = model_state(version)
    same = all(torch.equal(out["model"][k], expected[k]) for k in expected)
    return version if same else None
