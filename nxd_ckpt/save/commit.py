"""The commit of a save, once this rank's files are written: ``done`` last, and the same outcome on every rank.

``commit`` runs over the commit barrier (``barrier.CommitBarrier``) on every rank: each rank arrives (with its
error, if any); rank 0 waits for all, writes the tag's metadata and ``done`` last (only if nobody failed,
``CommitTarget`` says where and what) and publishes the outcome, which every other rank waits for. Every rank
then raises the same failure, or none. Retention comes after, in ``format.retention``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.metadata import TagMetadata, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.ranks.failures import RankFailure, mark_origin
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.storage import Storage
from nxd_ckpt.watchdog import StorageMonitor, run_watched

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class CommitTarget:
    """What rank 0's commit writes: where, and the facts recorded in the tag's metadata."""

    storage: Storage
    """The checkpoint directory (checksumming and watched: rank 0's manifest lists the metadata file too)."""
    tag: str
    created_at: float
    topology: Topology
    world_size: int
    zero1: bool
    use_xser: bool
    items: tuple[str, ...]
    monitor: StorageMonitor
    saved_async: bool | None = None
    sharding: ShardingRecord | None = None
    resave_of: Storage | None = None
    """Set when the tag already held a complete checkpoint: the storage in which the re-save is swapped in."""
    durable: bool = True
    """False for a save to the memory tier only: the checkpoint directory gets no ``done``."""
    root: Storage | None = None
    """The checkpoint directory itself (unwrapped): where ``done`` is recorded in the root's tag index."""

    def metadata(self) -> TagMetadata:
        """The tag's ``nxd_ckpt.json``: layout, encoding, contents and sharding of this save."""
        topo = self.topology
        return TagMetadata(
            tag=self.tag,
            created_at=self.created_at,
            tp=topo.tp_size,
            pp=topo.pp_size,
            dp=topo.dp_size,
            cp=topo.cp_size,
            ep=topo.ep_size,
            world_size=self.world_size,
            zero1=self.zero1,
            zero1_dp_size=topo.zero1_size if self.zero1 else None,
            xser=self.use_xser,
            saved_async=self.saved_async,
            items=self.items,
            torch_version=torch.__version__,
            sharding=self.sharding,
        )


def write_done(target: CommitTarget) -> None:
    """Rank 0, every rank's files being durable: metadata, rank 0's manifest again, then ``done`` (durably)."""
    storage = target.storage
    write_metadata(storage, target.metadata())
    storage.write_manifest()  # rank 0's manifest again, now listing the metadata file too
    storage.sync_dirs([target.tag, ""])  # the tag's entries are durable before 'done' can be
    storage.write_bytes(layout.tag_path(target.tag, layout.DONE_MARKER), b"1")
    storage.sync_dirs([target.tag])  # 'done' is durable before retention deletes older tags
    if target.resave_of is not None:  # the complete re-save takes the tag's name from the old checkpoint
        tags.swap_in_resave(target.resave_of, target.tag)
    if target.root is not None:  # after 'done': the index never names a tag before it is complete
        tags.record_committed(target.root, target.tag, target.created_at)


def arrive(barrier: CommitBarrier, error: BaseException | None, rank: int) -> None:
    """Tell rank 0 this rank is finished (with ``error``, if it failed). If the store is gone (rank 0 gave up
    and exited), this rank's own failure is what its caller needs."""
    try:
        barrier.arrive(error)
    except Exception as store_error:
        if error is None:
            raise
        logger.warning("rank %d could not report its failure to rank 0's commit: %s", rank, store_error)
        raise error from store_error


def commit(barrier: CommitBarrier, target: CommitTarget, rank: int, error: BaseException | None) -> None:
    """Every rank, once its files are written (or ``error`` stopped it): arrive, then learn the outcome. Raises
    this rank's own error, else the save's failure (as its original type on every rank)."""
    if error is not None:
        mark_origin(error, rank)
    arrive(barrier, error, rank)
    if rank != 0:
        if error is not None:
            raise error
        # Async saves wait here too (on the writer thread), so a failure on any rank is raised on every rank
        # by its next save/finalize.
        barrier.wait_outcome()
        return
    outcome, commit_error = _decide(barrier, target)
    barrier.publish_outcome(outcome)
    if error is not None:
        raise error
    if commit_error is not None:
        mark_origin(commit_error, 0)
        raise commit_error
    if outcome is not None:  # another rank failed: the same exception type as there
        raise outcome.to_exception()


def _decide(barrier: CommitBarrier, target: CommitTarget) -> tuple[RankFailure | None, BaseException | None]:
    """Rank 0: wait for every rank, write ``done`` if none failed; the outcome to publish, and rank 0's own
    commit error (ranks that never arrived count as one)."""
    commit_error: BaseException | None = None
    try:
        failures = barrier.wait_all_arrived()
    except CheckpointTimeoutError as e:  # ranks that never arrived: the save fails, on every rank
        failures, commit_error = {}, e
    if not failures and commit_error is None and target.durable:
        try:
            target.monitor.reset(f"committing {target.tag!r} on rank 0")
            run_watched(lambda: write_done(target), target.monitor, "nxd_ckpt_commit")
        except BaseException as e:
            commit_error = e
    if commit_error is not None:
        return RankFailure.of(commit_error, 0, barrier.phase), commit_error
    if not failures:
        return None, None
    first, *others = sorted(failures)
    outcome = failures[first]
    if others:
        outcome = dataclasses.replace(
            outcome, message=f"{outcome.message} (rank(s) {others} failed too; see their logs)"
        )
    return outcome, None
