"""The coordinator's wait, before its commit, for every rank's files, under the writer's deadline.

Each rank checks in on the c10d store (``ranks.arrivals``) when its ``write_data`` ends, written or failed; the
coordinator waits there until all have, past the deadline raising CheckpointTimeoutError that names the ranks
that never checked in. DCP's own gather of the ranks' results waits under the process group's timeout and names
nobody; this wait comes first, so the save's error says which rank was missing. A world of one (no process
group) has nothing to wait for.
"""

from __future__ import annotations

from nxd_ckpt.ranks.arrivals import ARRIVAL_GROUP, all_arrived_key, arrive, forget_step, missing_ranks, wait_for_key
from nxd_ckpt.ranks.coordinator import Coordinator

_PREFIX = "nxd_ckpt/dcp/written"


class WrittenCheckIn:
    """The check-in of one save's ranks (``key``: the save's id, the same on every rank)."""

    def __init__(self, key: str, rank: int, world_size: int) -> None:
        self.prefix = f"{_PREFIX}/{key}"
        self.rank = rank
        self.world_size = world_size
        self.store = Coordinator().store if world_size > 1 else None

    def check_in(self) -> None:
        """This rank's ``write_data`` has ended (its files and manifest are durable, or it failed)."""
        if self.store is not None:
            arrive(self.store, self.prefix, self.rank, self.world_size)

    def wait_for_all(self, what: str, timeout_s: float) -> None:
        """Coordinator: wait until every rank checked in; CheckpointTimeoutError naming the missing ranks past
        ``timeout_s``. The step's keys are deleted once all are in."""
        store = self.store
        if store is None:
            return
        wait_for_key(
            store,
            all_arrived_key(self.prefix),
            lambda limit: missing_ranks(store, self.prefix, self.world_size, limit),
            f"committing {what}: waiting for every rank's files",
            timeout_s,
            log=True,
        )
        for first in range(0, self.world_size, ARRIVAL_GROUP):
            forget_step(store, self.prefix, first)
