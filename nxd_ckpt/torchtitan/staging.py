"""The one seam between the TorchTitan manager and what stages its asynchronous saves: ``nxd_ckpt.dcp.Stager``.

Both of TorchTitan's async modes (``async`` and ``async_with_pinned_mem``) stage through the library's stager:
``dcp.async_save`` blocks only for the device snapshot (accelerator state; its host copies travel into pinned
buffers on the transfer thread) or a copy into host buffers reused across saves (CPU state), within the Config's
``host_memory_budget`` and ``device_snapshot_budget``. The write runs on a thread of the training process (not a
subprocess as TorchTitan's manager does it), so the writer's deadlines and errors stay in the process.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import Any

from nxd_ckpt.dcp import Stager
from nxd_ckpt.device.backend import resolve_snapshot_budget
from nxd_ckpt.options import resolve_budget
from nxd_ckpt.ranks.deadlines import Deadline, resolve_timeout

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
"""TorchTitan's ``checkpoint.async_mode`` values (its DCP manager's ``AsyncMode``)."""


def check_budgets(host_memory_budget: Any, device_snapshot_budget: Any) -> None:
    """ValueError (naming the Config field) for a budget ``Stager`` would refuse, when the Config is built."""
    try:
        resolve_budget(host_memory_budget)
        resolve_snapshot_budget(device_snapshot_budget)
    except ValueError as e:
        raise ValueError(f"checkpoint: {e}") from e


def make_stager(
    async_mode: str,
    host_memory_budget: int | str | None = None,
    device_snapshot_budget: int | str | None = None,
    timeout_s: float | None = None,
) -> Stager | None:
    """The stager of ``async_mode``'s saves, created once per manager and reused (its host and pinned buffers are
    kept across saves; the manager's ``close`` closes it); None for synchronous saves (``disabled``)."""
    if async_mode == "disabled":
        return None
    return Stager(host_memory_budget, device_snapshot_budget, timeout=timeout_s)


def wait_for_staging(future: Future, timeout_s: float | None, rank: int) -> None:
    """Wait (under the library's deadline) until the staging ``future`` of an async save is done; its error is
    raised here, and a staging that never ends raises CheckpointTimeoutError naming ``rank``."""
    deadline = Deadline(resolve_timeout(timeout_s), rank)
    try:
        future.result(timeout=deadline.timeout_s)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise  # the staging itself timed out: its own error
        raise deadline.expired(
            "staging an async TorchTitan checkpoint", "the device snapshot's host copies to arrive"
        ) from None
