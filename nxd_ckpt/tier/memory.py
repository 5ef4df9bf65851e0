"""The memory tier: each node keeps the newest checkpoints in a host-memory directory, with copies on peer nodes.

Layout of one node's memory directory (``MemoryTier.dir``, default ``/dev/shm/nxd_ckpt``, one per node, it
outlives the training process): ``<dir>/ckpt-<hash of the checkpoint directory>/node_NNNNN/<tag>/...``. Each
``node_NNNNN`` is a *share*: the files the ranks of node NNNNN wrote for a save, in the ordinary tag layout
(state files, per-rank manifests, rank 0's metadata). A node holds its own share and, with ``replicas=R``, the
shares of the R nodes before it in the ring (node n's share is copied to nodes n+1 .. n+R).

A rank's part of a share counts only when its tier marker ``<tag>/nxd_ckpt/tier_rank_RRRRR.json`` exists: it is
written after the rank's files and manifest (locally, and pushed last to each peer), so a copy interrupted at
any point has no marker. A tag can be restored from memory when, for every rank of the job that saved it, some
live node holds that rank's marker; every file read is then checked against the manifests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from nxd_ckpt import knobs
from nxd_ckpt.errors import CheckpointError, MemoryTierFullError
from nxd_ckpt.format import layout

logger = logging.getLogger("nxd_ckpt")

DEFAULT_MEMORY_DIR = "/dev/shm/nxd_ckpt"
TIERS = ("memory", "peer", "durable")
"""Where a rank restored from: its own node's memory directory, another node's (fetched), durable storage."""


@dataclass(frozen=True)
class MemoryTier:
    """Opt-in host-memory tier: every save goes to node memory (and ``replicas`` peer nodes), durable storage
    every ``durable_every`` saves, at most ``max_copies`` tag copies (own and replica) per node."""

    dir: str | None = None
    """Node-local directory (default ``NXD_CKPT_MEMORY_DIR``, else ``/dev/shm/nxd_ckpt``); ``{node}`` in it is
    replaced by the node index (several simulated nodes on one machine)."""
    replicas: int = 1
    """How many other nodes hold a copy of each node's files (0: none; needs more nodes than this)."""
    durable_every: int = 1
    """Every K-th save through this tier also goes to the checkpoint directory (1: every save)."""
    max_copies: int = 4
    """The most tag copies one node's memory directory holds, its own and replicas, the save being written included."""
    bind: str = "0.0.0.0"
    """Address the node's file server listens on (peers fetch and push files through it)."""

    def __post_init__(self) -> None:
        for name, minimum in (("replicas", 0), ("durable_every", 1), ("max_copies", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"MemoryTier.{name} must be an integer >= {minimum}, got {value!r}")
        if self.tags_kept < 2:
            raise ValueError(
                f"MemoryTier(max_copies={self.max_copies}, replicas={self.replicas}) holds fewer than 2 tags of "
                f"{self.copies_per_tag} copies each (own + replicas): the newest complete checkpoint would be "
                f"deleted while the next one is written; use max_copies >= {2 * self.copies_per_tag}"
            )

    @property
    def copies_per_tag(self) -> int:
        return 1 + self.replicas

    @property
    def tags_kept(self) -> int:
        """Tags the budget holds per node, the one being written included."""
        return self.max_copies // self.copies_per_tag

    def node_dir(self, node: int) -> str:
        base = self.dir or knobs.memory_dir() or DEFAULT_MEMORY_DIR
        return os.path.abspath(base.replace("{node}", str(node)))

    def root(self, node: int, checkpoint_url: str) -> str:
        """Where this job's memory tier lives on ``node``: one folder per checkpoint directory."""
        key = hashlib.sha256(checkpoint_url.encode()).hexdigest()[:12]
        return os.path.join(self.node_dir(node), f"ckpt-{key}")


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: ranks ``n*per_node .. (n+1)*per_node - 1`` are node n (torchrun's numbering)."""

    world_size: int
    per_node: int

    @property
    def count(self) -> int:
        return self.world_size // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def peer_ranks(self, rank: int, replicas: int) -> list[int]:
        """The ranks that receive ``rank``'s copies: its local rank on each of the next ``replicas`` nodes."""
        node, local = divmod(rank, self.per_node)
        return [((node + i) % self.count) * self.per_node + local for i in range(1, replicas + 1)]


def nodes_of(world_size: int, local_world_size: int, hosts: list[str], replicas: int) -> Nodes:
    """The nodes from LOCAL_WORLD_SIZE, checked against the host names; a clear error if replicas cannot fit."""
    if local_world_size < 1 or world_size % local_world_size:
        raise CheckpointError(
            f"the memory tier needs the world ({world_size} ranks) to be whole nodes of LOCAL_WORLD_SIZE="
            f"{local_world_size} ranks; set LOCAL_WORLD_SIZE to the ranks per node"
        )
    nodes = Nodes(world_size, local_world_size)
    if len(set(hosts)) > 1:
        for node in range(nodes.count):
            names = {hosts[r] for r in nodes.ranks_of(node)}
            if len(names) != 1:
                raise CheckpointError(
                    f"ranks {nodes.ranks_of(node)} should be one node (LOCAL_WORLD_SIZE={local_world_size}) but run "
                    f"on hosts {sorted(names)}; the memory tier needs ranks numbered node by node (as torchrun does)"
                )
    if replicas >= nodes.count:
        raise CheckpointError(
            f"MemoryTier(replicas={replicas}) needs more than {replicas} node(s), but this job has {nodes.count} "
            f"(world {world_size}, LOCAL_WORLD_SIZE={local_world_size}); use replicas={max(0, nodes.count - 1)}"
        )
    return nodes


def host_name() -> str:
    """The name peers reach this node's file server by."""
    return knobs.memory_tier_host() or socket.gethostname()


# ------------------------------------------------------------------------------------------- markers, listing
def share_dir(root: str, node: int) -> str:
    return os.path.join(root, layout.memory_share_dir(node))


@dataclass(frozen=True)
class Marker:
    """One rank's complete part of a share: which node's share, tag, writer rank, save time, world size."""

    share: int
    tag: str
    rank: int
    created_at: float
    world_size: int

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": "nxd_ckpt.tier_marker",
                "share": self.share,
                "tag": self.tag,
                "rank": self.rank,
                "created_at": self.created_at,
                "world_size": self.world_size,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, data: bytes) -> Marker:
        doc = json.loads(data)
        if doc.get("format") != "nxd_ckpt.tier_marker":
            raise ValueError("not a tier marker")
        return cls(int(doc["share"]), layout.validate_tag(doc["tag"]), int(doc["rank"]), float(doc["created_at"]),
                   int(doc["world_size"]))  # fmt: skip


def list_markers(root: str) -> list[Marker]:
    """Every complete rank part held in this node's memory directory (unreadable markers are skipped, logged)."""
    out: list[Marker] = []
    if not os.path.isdir(root):
        return out
    for share_name in sorted(os.listdir(root)):
        share = layout.parse_memory_share_dir(share_name)
        if share is None:
            continue
        for tag in sorted(os.listdir(os.path.join(root, share_name))):
            extras = os.path.join(root, share_name, tag, layout.EXTRAS_DIR)
            if not os.path.isdir(extras):
                continue
            for name in os.listdir(extras):
                if layout.parse_tier_marker_name(name) is None:
                    continue
                try:
                    with open(os.path.join(extras, name), "rb") as f:
                        marker = Marker.parse(f.read())
                except (OSError, ValueError, KeyError, TypeError) as e:
                    logger.warning("ignoring damaged memory-tier marker %s: %s", os.path.join(extras, name), e)
                    continue
                if marker.share == share and marker.tag == tag:
                    out.append(marker)
    return out


# ------------------------------------------------------------------------------------------- budget, eviction
def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def tags_by_age(
    root: str, own_share: int | None = None, own_ranks: Sequence[int] = ()
) -> list[tuple[bool, float, str]]:
    """(complete here, newest save time, tag) of every tag in any share of this node, in eviction order: tags
    whose own share lacks a marker of one of ``own_ranks`` first (a failed or interrupted save), then oldest
    first (no marker at all: time 0)."""
    times: dict[str, float] = {}
    if os.path.isdir(root):
        for share_name in os.listdir(root):
            if layout.parse_memory_share_dir(share_name) is None:
                continue
            for tag in os.listdir(os.path.join(root, share_name)):
                times.setdefault(tag, 0.0)
    held: dict[str, set[int]] = {}
    for marker in list_markers(root):
        times[marker.tag] = max(times[marker.tag], marker.created_at)
        if marker.share == own_share:
            held.setdefault(marker.tag, set()).add(marker.rank)
    complete = {tag: own_share is None or set(own_ranks) <= held.get(tag, set()) for tag in times}
    return sorted((complete[tag], t, tag) for tag, t in times.items())


def doomed_tags(
    root: str, keep: int, protect: str, own_share: int | None = None, own_ranks: Sequence[int] = ()
) -> list[str]:
    """Tags eviction deletes before ``protect`` is written: all but the ``keep - 1`` others it keeps, which are
    the newest complete ones (see ``tags_by_age``)."""
    others = [tag for _, _, tag in tags_by_age(root, own_share, own_ranks) if tag != protect]
    return others[: max(0, len(others) - (keep - 1))]


def evict(root: str, keep: int, protect: str, own_share: int | None = None, own_ranks: Sequence[int] = ()) -> list[str]:
    """Delete, in every share of this node, the tags ``doomed_tags`` selects (markers first, then the files)."""
    doomed = doomed_tags(root, keep, protect, own_share, own_ranks)
    for tag in doomed:
        for share_name in os.listdir(root):
            if layout.parse_memory_share_dir(share_name) is None:
                continue
            tag_dir = os.path.join(root, share_name, tag)
            extras = os.path.join(tag_dir, layout.EXTRAS_DIR)
            if os.path.isdir(extras):
                for name in os.listdir(extras):
                    if layout.parse_tier_marker_name(name) is not None:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(extras, name))
            shutil.rmtree(tag_dir, ignore_errors=True)
    return doomed


def check_budget(
    root: str, tier: MemoryTier, tag: str, need_bytes: int, own_share: int | None = None, own_ranks: Sequence[int] = ()
) -> None:
    """Raise MemoryTierFullError (before anything is staged) if this node cannot hold the next save: the free
    space of the memory filesystem plus what eviction frees must cover ``need_bytes``."""
    os.makedirs(root, exist_ok=True)
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    if free >= need_bytes:  # the usual case: nothing to walk
        return
    freed = sum(
        _tree_bytes(os.path.join(root, share, victim))
        for victim in doomed_tags(root, tier.tags_kept, tag, own_share, own_ranks)
        for share in os.listdir(root)
        if layout.parse_memory_share_dir(share) is not None
    )
    if free + freed < need_bytes:
        gib = 1 << 30
        raise MemoryTierFullError(
            f"the memory tier in {root} cannot hold checkpoint {tag!r}: about {need_bytes / gib:.2f} GiB needed on "
            f"this node ({tier.copies_per_tag} copies of this node's files), {free / gib:.2f} GiB free and "
            f"{freed / gib:.2f} GiB freed by evicting older tags. Make the memory filesystem larger (e.g. /dev/shm), "
            "lower MemoryTier.max_copies or replicas, or save without memory_tier"
        )


# ------------------------------------------------------------------------------------------- choosing a tag
@dataclass(frozen=True)
class Report:
    """What one rank's node holds, and where its file server is."""

    rank: int
    node: int
    address: str
    markers: tuple[Marker, ...]


@dataclass(frozen=True)
class MemoryChoice:
    """The newest tag every rank's part of is held by some live node; ``holders[q]`` = nodes holding rank q's."""

    tag: str
    created_at: float
    world_size: int
    holders: dict[int, tuple[int, ...]] = field(default_factory=dict)
    shares: dict[int, int] = field(default_factory=dict)
    """The share (the saving node) of each writer rank's files."""


def choose_memory_tag(reports: list[Report], tag: str | None = None) -> MemoryChoice | None:
    """The newest (or the named) tag restorable from memory, from every rank's report; None if there is none."""
    parts: dict[tuple[str, float, int], dict[int, set[int]]] = {}
    shares: dict[tuple[str, float, int], dict[int, int]] = {}
    for report in reports:
        for m in report.markers:
            if tag is not None and m.tag != tag:
                continue
            key = (m.tag, m.created_at, m.world_size)
            parts.setdefault(key, {}).setdefault(m.rank, set()).add(report.node)
            shares.setdefault(key, {})[m.rank] = m.share
    candidates = sorted(parts.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True)
    for key, holders in candidates:
        name, created_at, world = key
        if all(q in holders for q in range(world)):
            held = {q: tuple(sorted(h)) for q, h in holders.items() if q < world}
            return MemoryChoice(name, created_at, world, held, {q: shares[key][q] for q in held})
    return None
