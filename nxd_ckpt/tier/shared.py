"""The memory tier for callers that keep no manager of their own (the DCP writer and reader, built anew for
every save and load): one ``TierRuntime`` per memory tier and checkpoint directory in this process, built
collectively on first use and kept until ``close_runtimes``, and a restore's choice of copy in one call.

The node layout comes from torchrun's environment (``LOCAL_WORLD_SIZE`` ranks per node, ``LOCAL_RANK``), as
``parallel_state`` reads it for the NxD path. ``memory_view`` is collective (every rank reports what its node
holds); a save's tier work needs no collective after the runtime is built (``TierRuntime.begin_save``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from nxd_ckpt.ranks.coordinator import Coordinator, world_rank, world_size
from nxd_ckpt.tier.memory import MemoryChoice, MemoryTier, Report, choose_memory_tag
from nxd_ckpt.tier.runtime import TierRuntime, close_quietly
from nxd_ckpt.tier.view import TierView

_lock = threading.Lock()
_runtimes: dict[tuple[MemoryTier, str, int, int], SharedTier] = {}


@dataclass(frozen=True)
class SharedTier:
    """One process's memory tier of one checkpoint directory: the run-time and the coordinator of its steps."""

    runtime: TierRuntime
    coord: Coordinator

    def newest(
        self, tag: str | None = None, timeout_s: float | None = None
    ) -> tuple[MemoryChoice | None, list[Report]]:
        """(Collective.) The newest tag (or ``tag``) every rank's part of is held by some live node, None if
        none, and every rank's report (``choose_memory_tag``)."""
        with self.coord.deadline(timeout_s or self.coord.timeout_s):
            reports = self.coord.all_gather_object(
                self.runtime.report(), phase=f"memory tier: what each node holds of {self.runtime.url}"
            )
        return choose_memory_tag(reports, tag), reports

    def memory_view(self, tag: str, timeout_s: float | None = None) -> TierView | None:
        """(Collective.) A read view of ``tag`` assembled from node memory (this node's copy of each rank's files
        where it holds one, else a peer node's), or None when the tier holds no complete copy of it."""
        choice, reports = self.newest(tag, timeout_s)
        if choice is None:
            return None
        return self.runtime.view(choice, reports, prefer_remote=False)


def node_layout() -> tuple[int, int]:
    """(ranks per node, this rank's index on its node) from torchrun's ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK``
    (default: one node)."""
    world, rank = world_size(), world_rank()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local_world, int(os.environ.get("LOCAL_RANK", rank % max(local_world, 1)))


def shared_tier(tier: MemoryTier, url: str, timeout_s: float | None = None) -> SharedTier:
    """The memory tier of the checkpoint directory ``url`` (a DCP checkpoint's parent folder), built on first use:
    collective then (every rank must call it at the same point, on the thread that drives training)."""
    local_world, local_rank = node_layout()
    key = (tier, url, world_size(), local_world)
    with _lock:
        found = _runtimes.get(key)
    if found is not None:
        return found
    coord = Coordinator(timeout_s=timeout_s)
    shared = SharedTier(TierRuntime(tier, url, coord, local_world, local_rank), coord)
    with _lock:
        _runtimes[key] = shared
    return shared


def close_runtimes(url: str | None = None) -> None:
    """Stop the file servers of the memory tiers of ``url`` (None: every one) built by ``shared_tier``; the next
    ``shared_tier`` builds a new one (collectively)."""
    with _lock:
        doomed = [k for k in _runtimes if url is None or k[1] == url]
        closing = [_runtimes.pop(k) for k in doomed]
    for shared in closing:
        close_quietly(shared.runtime)
