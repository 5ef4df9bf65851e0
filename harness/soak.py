"""Soak: many async saves of a small device state in one process. What a save holds (device memory, pinned host
memory, threads, open files) must be given back, so after a warm-up these stay flat however many saves follow."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness import native_state
from nxd_ckpt import xla
from nxd_ckpt.manager import CheckpointManager


@dataclass(frozen=True)
class Held:
    """What the process holds between saves (every background job done)."""

    device: int
    """Device memory in use: the fake accelerator's live bytes, or the number of live XLA tensors."""
    pinned: int
    """Pinned host memory the staging pool ever allocated (its buffers and arena)."""
    threads: int
    files: int
    """Open file descriptors."""


def device_in_use(device: str) -> int:
    """The fake accelerator's live bytes, or torch_xla's live tensors (created minus destroyed)."""
    if torch.device(device).type == "xla":
        import torch_xla.debug.metrics as metrics

        return int(metrics.counter_value("CreateXlaTensor") or 0) - int(metrics.counter_value("DestroyXlaTensor") or 0)
    from harness import fake_accelerator

    return fake_accelerator.live_bytes()


def held(manager: CheckpointManager, device: str) -> Held:
    """What the process holds now, once every background job of ``manager`` is done."""
    manager.wait_pending()
    pool = manager._staging_pool
    arena = pool._arena.allocated_bytes if pool._arena is not None else 0
    return Held(
        device=device_in_use(device),
        pinned=pool.pinned.allocated_bytes + arena,
        threads=threading.active_count(),
        files=len(os.listdir("/proc/self/fd")),
    )


@contextlib.contextmanager
def memory_dir(fallback: Any) -> Iterator[str]:
    """A checkpoint directory in memory (``/dev/shm``, removed after), else ``fallback``."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield str(fallback)
        return
    path = tempfile.mkdtemp(prefix="nxd_ckpt_soak_", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def saves_hold_nothing(path: str, device: str, saves: int, every: int, **keywords: Any) -> list[Held]:
    """``saves`` async saves of a small model and optimizer (a step before each, ``num_kept_ckpts=2``), what the
    process holds measured every ``every`` saves; each measure after the first must equal it (the first is the
    warm-up: pinned buffers, threads started once). Returns the measures."""
    manager = CheckpointManager()
    model, opt = native_state.training(device, 16)
    measures: list[Held] = []
    for i in range(saves):
        native_state.steps(model, opt, 1, seed=i)
        xla.mark_step()  # XLA: the step runs here, as a training loop's sync runs it
        manager.save(path, f"step_{i}", model=model, optimizer=opt, async_save=True, num_kept_ckpts=2, **keywords)
        if (i + 1) % every == 0:
            measures.append(held(manager, device))
    manager.finalize()
    grown = [(i, m) for i, m in enumerate(measures[1:], start=2) if m != measures[0]]
    assert not grown, f"after {every} saves the process held {measures[0]}; later: {grown}"
    return measures
