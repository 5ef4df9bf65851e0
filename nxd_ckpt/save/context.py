"""What the steps of a save hand each other: ``SaveServices`` (what the manager lends one save) in, ``SaveOutcome``
out, and between the steps ``SaveContext`` (one save's identity and targets), ``Captured`` (what ``begin`` read),
``Staged`` (what ``write`` writes); ``SaveTimer`` is the save's one clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from nxd_ckpt.device.kept_budget import KeptSnapshotBudget
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.format import integrity
from nxd_ckpt.format.sharding_marks import ShardingShare
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import budget, commit, plan, staging
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.save.commit import CommitTarget
from nxd_ckpt.save.replicated import OptimizerFingerprint
from nxd_ckpt.save.writer import AsyncWriter
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.runtime import TierRuntime, TierSave
from nxd_ckpt.watchdog import StorageMonitor


class SaveTimer:
    """The one clock of a save (``time.perf_counter``), started at the call: every duration in its SaveReport is
    read off it."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    @staticmethod
    def now() -> float:
        """A reading to measure a step from (``since``)."""
        return time.perf_counter()

    def since(self, start: float | None = None) -> float:
        """Seconds since ``start`` (a ``now`` reading), or since the call."""
        return time.perf_counter() - (self.started if start is None else start)


@dataclass(frozen=True)
class SaveServices:
    """What the manager hands one save: its per-process objects, and this call's number and clock."""

    coordinator: Coordinator
    session: str
    """The store namespace of this manager's commits (identical on every rank)."""
    seq: int
    """The number this save takes once ``begin`` agrees on it: one more than the last begun save's (identical on
    every rank); handed back in ``SaveOutcome.seq``."""
    writer: AsyncWriter
    """The background writer thread (started by an async save before it copies anything, else by its first job)."""
    staging_pool: staging.StagingPool
    timer: SaveTimer
    """Started at the call, before the wait for the previous save."""
    topology: Callable[[], Topology]
    """Read inside ``begin``'s first collective, so that a rank failing to read it fails the save on every rank."""
    storage_for: Callable[[Any], Storage]
    """The checkpoint directory's storage (the manager's injected factory)."""
    tier_runtime: Callable[[MemoryTier, str, Topology], TierRuntime]
    """The memory tier's run-time state for a checkpoint directory (set up collectively on first use, and kept by
    the manager for later saves and loads)."""
    pending_deletions: tuple[Future, ...] = ()
    """Deletions still running on the writer thread (retention, Lightning's removals): a save does not wait for
    them, except rank 0 before it touches a tag of the same name (``prepare_tag``)."""
    device_budget: KeptSnapshotBudget = field(default_factory=KeptSnapshotBudget)
    model_state: Any = None
    """The model's state dict, built once per save by the manager before any collective (``capture.model_state``,
    which also refuses meta tensors); None: the save builds it."""
    """The device snapshot budget kept from save to save (the manager's): each save proposes it, agrees on it."""


@dataclass(frozen=True)
class SaveOutcome:
    """What one save hands back to the manager, whether it succeeded or not."""

    seq: int | None = None
    """The sequence number it used (None when it failed before ``begin`` agreed on the save)."""
    job: Future[str | None] | None = None
    """Async saves: the write-and-commit job on the writer thread; its result is the failure it reported under
    ``on_save_error="warn"`` (None when it succeeded), for the next save's ``earlier_failures``."""
    retention: Future | None = None
    """Rank 0: the retention job queued behind the save."""
    error: BaseException | None = None
    """The error the caller raises (``on_save_error="raise"``, or not an ``Exception``); under "warn" a failure is
    recorded in the SaveReport instead."""


@dataclass(frozen=True)
class Captured:
    """What ``begin`` read from the live objects, as it was at the call (``capture.capture``): the model's state
    dict, this rank's per-rank state files (path, host state; copies for async saves), and what the save's first
    world-wide step needs of them."""

    model: Any
    rank_files: list[tuple[str, Any]]
    sharding_share: ShardingShare = None
    """This rank's share of the sharding record (``sharding_marks.share_for_save``)."""
    zero1: bool = False
    """The optimizer's state is sharded ZeRO-1 (told, or recognised)."""
    budget_proposal: int | None = None
    """An async save's proposal of a device snapshot budget (``capture.budget_proposal``)."""
    optimizer_fingerprint: OptimizerFingerprint | None = None
    """A plain optimizer's state in short, where the model has replicas: every replica's must be the same
    (``replicated.check_replicas``); None for ZeRO-1 state, no optimizer, or no replicas."""


@dataclass(frozen=True)
class Destination:
    """Where one save goes, as ``begin`` learns it before the save's first world-wide step: the checkpoint
    directory, the job's layout (checked on every rank), the memory tier's run-time (if the save goes through
    it) and whether the save reaches the checkpoint directory (a tier-only save does not)."""

    storage: Storage
    topology: Topology
    runtime: TierRuntime | None = None
    durable: bool = True


@dataclass(frozen=True)
class SaveContext:
    """One save as every step sees it: its options, identity and where its files go."""

    options: SaveOptions
    commit: CommitTarget
    """Rank 0's commit: the checkpoint directory (checksumming, watched) and the tag's metadata."""
    seq: int
    coordinator: Coordinator
    session: str
    runtime: TierRuntime | None = None
    """The memory tier's run-time, when the save goes through the tier."""
    tier: TierSave | None = None
    """This rank's part of the save in the memory tier, if one is used."""

    @property
    def tag(self) -> str:
        return self.commit.tag

    @property
    def storage(self) -> integrity.ChecksummingStorage:
        return self.commit.storage  # type: ignore[return-value]

    @property
    def monitor(self) -> StorageMonitor:
        return self.commit.monitor

    def barrier(self) -> CommitBarrier:
        """This save's commit barrier (``commit.open_barrier``)."""
        coord = self.coordinator
        return commit.open_barrier(
            coord.store, self.session, self.seq, coord.rank, coord.world_size, self.options.timeout_s, self.tag
        )

    @contextlib.contextmanager
    def arrive_on_failure(self) -> Iterator[None]:
        """A step before the write that fails tells rank 0's commit this rank will never write (instead of
        letting it wait until the deadline), then raises."""
        try:
            yield
        except BaseException as e:
            self.barrier().arrive(e)
            raise


@dataclass
class Staged:
    """What the write step writes: host copies (async) or the live state with a device fetcher (sync)."""

    writes: list[plan.StateWrite]
    lease: staging.StagedState | None = None
    """Async saves: the pooled host copy, handed back as soon as the files are written."""
    pool: staging.StagingPool | None = None
    """The pool the lease (or a budgeted save's pinned arena) came from."""
    fetcher: DeviceTransfer | budget.BudgetedStager | None = None
    """Device tensors: their host copies, arriving on a background thread ahead of the writers (from the device
    snapshot of an async save, from the live tensors of a sync one); async saves under a host memory budget: the
    copies the training thread makes in ``stage`` while the writer writes."""

    def host(self, monitor: StorageMonitor | None = None) -> Callable[[Any], Any] | None:
        """What writers ask for a tensor's host copy; while it waits for the device, ``monitor`` counts no storage
        stall (the wait has its own deadline, which names the transfer)."""
        if self.fetcher is None or monitor is None:
            return self.fetcher.host if self.fetcher is not None else None
        fetch = self.fetcher.host

        def host(t: Any) -> Any:
            with monitor.waiting_off_storage():
                return fetch(t)

        return host

    def close(self, monitor: StorageMonitor) -> tuple[BaseException | None, int]:
        """After the write: stop the fetcher and hand the copies back (never to be reused once ``monitor`` gave
        up on the write: an abandoned writer thread may still read them). Returns the fetcher's unseen error and
        the pinned host bytes a device transfer of an async save allocated."""
        error: BaseException | None = None
        pinned = 0
        if self.fetcher is not None:
            try:  # an unseen transfer error fails this rank's write, before it arrives
                self.fetcher.close()
            except BaseException as e:
                error = e
            if isinstance(self.fetcher, DeviceTransfer) and self.lease is not None:
                pinned = self.fetcher.allocated_bytes  # pinned on the transfer thread
        if self.lease is not None:
            self.lease.release()
        if monitor.cancelled and self.pool is not None:  # its memory may still be read: none of it is reused
            self.pool.clear()
        return error, pinned
