"""The coordinator's wait, before its commit, for every rank's files, under the writer's deadline, and its check
that each rank's manifest records them (``recorded_files``).

Each rank checks in on the c10d store (``ranks.arrivals``) when its ``write_data`` ends, written or failed; the
coordinator waits there until all have, past the deadline raising CheckpointTimeoutError that names the ranks
that never checked in. DCP's own gather of the ranks' results waits under the process group's timeout and names
nobody; this wait comes first, so the save's error says which rank was missing. A world of one (no process
group) has nothing to wait for.
"""

from __future__ import annotations

from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.format.manifests import FileRecord, parse_manifest
from nxd_ckpt.ranks.arrivals import ARRIVAL_GROUP, all_arrived_key, arrive, forget_step, missing_ranks, wait_for_key
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.storage import Storage

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


def recorded_files(
    storage: Storage, folder: str, path: str, world_size: int, needed: dict[str, int]
) -> dict[str, FileRecord]:
    """Coordinator: every rank's manifest of ``folder`` merged, each file ``.metadata`` points into recorded as
    written up to the end it needs (``needed``: file -> end of its last item); CheckpointError naming the first
    rank without a manifest, or the first file short of its bytes (``path``: the folder as the caller named it)."""
    records: dict[str, FileRecord] = {}
    for rank in range(world_size):
        manifest = layout.manifest_file(folder, rank)
        if not storage.exists(manifest):
            raise CheckpointError(
                f"{path}: rank {rank} has no manifest ({manifest}), so its files are not known to be durable; "
                "the save is not committed and the previous checkpoint stays; save again"
            )
        records.update(parse_manifest(storage.read_bytes(manifest), f"{storage.url}/{manifest}")[1])
    for rel, end in sorted(needed.items()):
        rec = records.get(rel)
        if rec is None or rec.size < end:
            state = "no manifest lists it" if rec is None else f"{rec.size} of {end} bytes"
            raise CheckpointError(
                f"{path}: {rel} is not recorded as written ({state}); the save is not committed and the "
                "previous checkpoint stays; save again"
            )
    return records
