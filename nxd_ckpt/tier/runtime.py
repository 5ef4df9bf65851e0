"""One manager's memory tier at run time: the node's file server, the peers' addresses, and the per-save and
per-restore steps (writing a rank's share, replicating it, copying it to durable storage, choosing sources).

Set-up (``TierRuntime``) happens on the training thread, at the first save or load through the tier: rank 0
makes the job's token, every rank starts its file server and the addresses are exchanged (two small steps of
``nxd_ckpt.ranks``). After that a save's tier work is one call on the writer thread with no collective
(``TierSave.write``): files go to the node's memory directory, then straight to the peers' file servers
(``transport.py``), then, every ``durable_every``-th save, to the checkpoint directory; the save's store-based
commit (``save/commit.py``) tells every rank whether the save succeeded everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

from nxd_ckpt.format import integrity, layout
from nxd_ckpt.format.metadata import TagMetadata, write_metadata
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.deadlines import stall_limit_s
from nxd_ckpt.storage import LocalStorage, Storage
from nxd_ckpt.tier.memory import (
    Marker,
    MemoryChoice,
    MemoryTier,
    Nodes,
    Report,
    check_budget,
    evict,
    host_name,
    list_markers,
    nodes_of,
    share_dir,
)
from nxd_ckpt.tier.transport import FileClient, FileServer
from nxd_ckpt.tier.view import Source, TierView
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage

logger = logging.getLogger("nxd_ckpt")


class TierRuntime:
    """The memory tier of one checkpoint directory for one process group (built collectively, once)."""

    def __init__(self, tier: MemoryTier, url: str, coord: Coordinator, local_world_size: int, local_rank: int) -> None:
        self.tier = tier
        self.url = url
        self.rank = coord.rank
        self.local_rank = local_rank
        world = coord.world_size
        self.nodes: Nodes = nodes_of(world, local_world_size, [], tier.replicas)  # the host check follows
        self.node = self.nodes.node_of(coord.rank)
        self.root = tier.root(self.node, url)
        os.makedirs(self.root, exist_ok=True)
        self.timeout_s = stall_limit_s(coord.timeout_s)
        # Until the job's token (rank 0's) is known, the server only accepts this rank's own secret one.
        self.server = FileServer(self.root, secrets.token_hex(16), self.timeout_s, tier.bind)
        self.address = f"{host_name()}:{self.server.port}"
        try:  # one step: addresses, rank 0's token and (if not known yet) the host names
            exchanged = coord.all_gather_with_hosts(
                (self.address, self.server.token), phase="memory tier: exchanging the file servers' addresses"
            )
            hosts = coord.host_names() if coord.distributed else ["localhost"]
            self.nodes = nodes_of(world, local_world_size, hosts, tier.replicas)
        except BaseException:
            self.server.close()
            raise
        self.addresses: list[str] = [address for address, _ in exchanged]
        token = exchanged[0][1]
        self.server.token = token
        self.client = FileClient(token, self.timeout_s)
        self.saves = 0
        """Saves through this run-time so far (identical on every rank)."""
        logger.debug("memory tier of %s: node %d of %d, %s, serving %s", url, self.node, self.nodes.count,
                     self.root, self.address)  # fmt: skip

    def close(self) -> None:
        self.server.close()

    # ------------------------------------------------------------------ saving
    def check_budget(self, tag: str, rank_bytes: int) -> None:
        """Before staging: this node can hold the save (estimated as this rank's bytes times the node's ranks
        times the copies per tag), after eviction."""
        need = rank_bytes * self.nodes.per_node * self.tier.copies_per_tag
        check_budget(self.root, self.tier, tag, need, self.node, self.nodes.ranks_of(self.node))

    def count_save(self) -> bool:
        """Count one more save through the tier; whether it also goes to the checkpoint directory (every
        ``durable_every``-th save)."""
        self.saves += 1
        return self.saves % self.tier.durable_every == 0

    def begin_save(self, tag: str, created_at: float, world_size: int, monitor: StorageMonitor) -> TierSave:
        return TierSave(self, tag, created_at, world_size, monitor)

    # ------------------------------------------------------------------ restoring
    def report(self) -> Report:
        return Report(self.rank, self.node, self.address, tuple(list_markers(self.root)))

    def view(self, choice: MemoryChoice, reports: list[Report], prefer_remote: bool) -> TierView | None:
        """The view of ``choice`` for this rank: each writer's files from this node if it holds them (else a
        peer); with ``prefer_remote``, from another node wherever one holds them (None if no share has one)."""
        by_node: dict[int, list[str]] = {}
        for r in sorted(reports, key=lambda r: r.rank):
            by_node.setdefault(r.node, []).append(r.address)
        sources: dict[int, Source] = {}
        any_remote = False
        for q, holders in choice.holders.items():
            others = [h for h in holders if h != self.node]
            use_local = self.node in holders and not (prefer_remote and others)
            if use_local:
                sources[q] = Source(choice.shares[q], local_root=self.root)
            else:
                node = others[(self.rank + q) % len(others)]
                addresses = by_node[node]
                sources[q] = Source(choice.shares[q], address=addresses[self.local_rank % len(addresses)])
                any_remote = True
        if prefer_remote and not any_remote:
            return None
        label = "peer" if prefer_remote else "memory"
        return TierView(f"memory tier ({label}) of {self.url}", choice.tag, sources, self.client)


class TierSave:
    """One rank's part of one save in the memory tier (used on the writer thread)."""

    def __init__(
        self, runtime: TierRuntime, tag: str, created_at: float, world_size: int, monitor: StorageMonitor
    ) -> None:
        self.rt = runtime
        self.tag = tag
        self.marker = Marker(runtime.node, tag, runtime.rank, created_at, world_size)
        self.share = LocalStorage(share_dir(runtime.root, runtime.node))
        self.monitor = monitor
        self.storage = integrity.ChecksummingStorage(WatchedStorage(self.share, monitor), tag, runtime.rank)
        """Where the save's writers write this rank's files (in node memory), recording their checksums."""

    def write(
        self,
        write_files: Callable[[Storage], list[str]],
        metadata: TagMetadata | None,
        durable: integrity.ChecksummingStorage | None,
        on_sealed: Callable[[], None] | None = None,
    ) -> list[str]:
        """This rank's part of a save through the tier, as one call: old tags evicted (``begin``), the files
        written into node memory (``write_files`` over this rank's share), rank 0's ``metadata`` (a restore from
        memory needs it; durable storage gets it at ``done``), the copy sealed, ``on_sealed`` (the state is in
        node memory: its staging buffers can be reused), the peers' copies, then, for a ``durable`` save, the
        checkpoint directory's copy with its directories synced and its manifest. Returns the paths written."""
        self.begin()
        written = write_files(self.storage)
        if metadata is not None:
            write_metadata(self.storage, metadata)
        self.seal()
        if on_sealed is not None:
            on_sealed()
        self.replicate()
        if durable is not None:
            self.copy_to(durable)
            durable.sync_dirs({p.rsplit("/", 1)[0] for p in written})
            durable.write_manifest()
        return written

    def begin(self) -> None:
        """Evict old tags (the node's first local rank), and drop this rank's marker of an older save of the tag."""
        if self.rt.local_rank == 0:
            rt = self.rt
            evicted = evict(rt.root, rt.tier.tags_kept, self.tag, rt.node, rt.nodes.ranks_of(rt.node))
            if evicted:
                logger.info("memory tier: evicted %s from %s", ", ".join(evicted), self.rt.root)
        self.share.delete(layout.tier_marker_file(self.tag, self.rt.rank))

    def seal(self) -> None:
        """This rank's files are in node memory: write its manifest, then its marker (the copy counts from now)."""
        self.storage.write_manifest()
        self.share.write_bytes(layout.tier_marker_file(self.tag, self.rt.rank), self.marker.to_bytes())

    def _files(self) -> list[str]:
        """This rank's files in the share (paths within the checkpoint directory), the manifest last."""
        return [f"{self.tag}/{rel}" for rel in sorted(self.storage.records)] + [
            layout.manifest_file(self.tag, self.rt.rank)
        ]

    def replicate(self) -> None:
        """Copy this rank's files to each peer node (marker removed first, written last there too)."""
        share = layout.memory_share_dir(self.rt.node)
        marker = layout.tier_marker_file(self.tag, self.rt.rank)
        for peer in self.rt.nodes.peer_ranks(self.rt.rank, self.rt.tier.replicas):
            address = self.rt.addresses[peer]
            self.rt.client.delete(address, f"{share}/{marker}")
            for path in [*self._files(), marker]:  # the marker last: the copy counts once it is there
                local = self.share.local_path(path)
                assert local is not None
                with self.monitor.call(f"copying to the memory tier of node {self.rt.nodes.node_of(peer)}", path):
                    self.rt.client.put_file(address, f"{share}/{path}", local)

    def copy_to(self, durable: integrity.ChecksummingStorage) -> None:
        """Write this rank's files to durable storage with the checksums recorded when they were written to node
        memory (each file is hashed once per save, not again for the durable copy)."""
        records = self.storage.records
        for path in self._files()[:-1]:
            local = self.share.local_path(path)
            assert local is not None
            durable.write_from_local_file(path, local, known=records.get(path[len(self.tag) + 1 :]))


def close_quietly(runtime: Any) -> None:
    if runtime is not None:
        with contextlib.suppress(Exception):
            runtime.close()
