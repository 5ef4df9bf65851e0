"""The one seam between the TorchTitan manager and what stages its asynchronous saves (DCP's ``AsyncStager``).

``async`` stages as TorchTitan's manager does (DCP's default: a blocking copy into fresh CPU tensors, then the
write on a thread). ``async_with_pinned_mem`` stages on a background thread (``staging_future``, awaited by
``maybe_wait_for_staging``) into buffers DCP's ``DefaultStager`` reuses across saves (pinned where CUDA is there).
Unlike TorchTitan's manager it writes from a thread of the training process, not a subprocess: the library's
writer keeps its deadlines and errors in this process. When ``nxd_ckpt.dcp.Stager`` (device snapshot, host and
device budgets) is merged, ``make_stager`` is the only place to change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
"""TorchTitan's ``checkpoint.async_mode`` values (its DCP manager's ``AsyncMode``)."""


def check_budgets(host_memory_budget: Any, device_snapshot_budget: Any) -> None:
    """The host and device budgets need ``nxd_ckpt.dcp.Stager``; ValueError saying so while it is not there."""
    for name, value in (("host_memory_budget", host_memory_budget), ("device_snapshot_budget", device_snapshot_budget)):
        if value is not None:
            raise ValueError(
                f"checkpoint.{name}={value!r} needs nxd_ckpt.dcp.Stager, which this version of nxd_ckpt does not "
                f"have yet; leave {name} unset (None)"
            )


def make_stager(async_mode: str) -> AsyncStager | None:
    """The stager for ``async_mode``'s saves, created once per manager and reused (closed by its ``close``);
    None where DCP's default staging is the one wanted (``async``) or nothing is staged (``disabled``)."""
    if async_mode != "async_with_pinned_mem":
        return None
    on_cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=on_cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=on_cuda,
        )
    )
