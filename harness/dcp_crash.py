"""Fault injection for DCP saves: a single-process ``dcp.save`` SIGKILLed at its N-th filesystem mutation, through
``nxd_ckpt.dcp.StorageWriter`` or DCP's own ``FileSystemWriter``, and a judge of what a folder then loads.

The saving process is forked from the test session's forkserver (torch, DCP and nxd_ckpt already imported), so a
kill costs a fraction of a second. The state of ``version`` is a pure function of it (``dcp_state``), so a load
is checked bit-exactly against the version it claims.
"""

from __future__ import annotations

import errno
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
from nxd_ckpt.format.layout import DCP_COMMIT
from nxd_ckpt.storage import local

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


def split_swaps_and_kill_between_renames(folder: str) -> None:
    """In this process, directories are swapped as on Lustre or NFS: ``renameat2(RENAME_EXCHANGE)`` fails with
    EINVAL (so ``LocalStorage.exchange_dirs`` falls back to two renames), and the process SIGKILLs itself at the
    second rename of a save of ``folder`` (its staged copy taking the name the first rename freed)."""

    def unsupported(a: str, b: str) -> None:
        raise OSError(errno.EINVAL, "renameat2(RENAME_EXCHANGE) is not supported by this filesystem")

    local.rename_exchange = unsupported  # type: ignore[assignment]
    staged, real = DCP_COMMIT.staging_dir(folder), os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(os.fspath(src)) == staged:
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst, *args, **kwargs)

    os.rename = rename  # type: ignore[assignment]


def _split_swap_child(path: str, version: int) -> None:
    """Save ``version`` into ``path`` through nxd_ckpt's writer, killed between the two renames of its swap."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    split_swaps_and_kill_between_renames(os.path.basename(path))
    dcp.save(dcp_state(version), storage_writer=StorageWriter(path), no_dist=True)
    os._exit(100)


def _titan_split_swap_child(base: str, step: int, seed: int) -> None:
    """A TorchTitan job (``harness.titan_job``, nxd_ckpt's manager, a gloo world of one) that trains from step
    ``step - 1`` with ``seed``'s weights and saves ``step``, killed between the two renames of that save."""
    from harness import titan_job
    from nxd_ckpt.torchtitan import CheckpointManager

    torch.set_num_threads(1)
    split_swaps_and_kill_between_renames(f"step-{step}")
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    with titan_job.gloo_world_of_one():
        job = titan_job.TitanJob(config, seed, base)
        job.train_state.step = step - 1
        job.train(1)
    os._exit(100)


def run_killed_between_renames(target: Any, *args: Any) -> None:
    """Run ``target(*args)`` (``_split_swap_child``, ``_titan_split_swap_child``) in a forked process; it must end
    SIGKILLed between the renames."""
    ctx = rank_context(__name__)
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    p.join(timeout=120)
    if p.exitcode != -signal.SIGKILL:
        raise AssertionError(f"the save was not killed between its renames (exit code {p.exitcode})")


def kill_dcp_save_between_renames(path: str, version: int) -> None:
    """Save ``version`` into the DCP folder ``path`` (nxd_ckpt's writer), killed between the two renames."""
    run_killed_between_renames(_split_swap_child, path, version)


def kill_titan_save_between_renames(base: str, step: int, seed: int) -> None:
    """A TorchTitan job under ``base`` saves ``step`` (see ``_titan_split_swap_child``), killed between renames."""
    run_killed_between_renames(_titan_split_swap_child, base, step, seed)
