"""The atomic commit of a tag, in one owner: how a save begins a tag, where its writers write, and how it ends,
``done`` last and the same outcome on every rank.

  begin   ``prepare_tag`` (rank 0, before anything is written): the ``checkpoint`` marker on a new tag, or a
          re-save beside a complete one (``format.resave``: the old copy stays loadable until the new one is
          complete), after the deletions still running on the tag's name (``wait_for_deletions``);
  write   ``open_target``: the storage the writers write the tag through (the re-save's hidden directory under
          the tag's names, every write seen by the watchdog, every file checksummed for the rank's manifest);
  end     ``commit`` over the commit barrier (``barrier.CommitBarrier``, its store transport: ``open_barrier``)
          on every rank: each rank arrives (with its error, if any); rank 0 waits for all, writes the tag's
          metadata and ``done`` last (``write_done``: only if nobody failed), swaps a re-save in, records the tag
          in the root's index, and publishes the outcome, which every other rank waits for. Every rank then
          raises the same failure, or none.

Retention comes after, in ``format.retention``. Recovery of a re-save a crash interrupted is
``format.resave.recover_resaves`` (``prepare_tag`` runs it first).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.format import integrity, layout, resave, tags
from nxd_ckpt.format.metadata import TagMetadata, metadata_path, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.ranks.failures import RankFailure, mark_origin
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.storage import Storage
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage, run_watched

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


# ---------------------------------------------------------------------------------------------------- begin
def prepare_tag(
    storage: Storage, tag: str, durable: bool, pending_deletions: Sequence[Future] = (), timeout_s: float = 1800.0
) -> tuple[float, bool]:
    """Rank 0, before anything is written: the save's creation time, and whether it re-saves a complete tag
    (written beside it and swapped in when complete, so the old one stays loadable until then). Deletions still
    running (``pending_deletions``) are waited for first where the directory holds anything of ``tag``."""
    if not durable:
        return time.time(), False
    if pending_deletions and names_tag(storage.list_dir(""), tag):
        wait_for_deletions(pending_deletions, tag, timeout_s)
    resave.recover_resaves(storage)  # a re-save a crash interrupted is finished or dropped first
    done = layout.tag_path(tag, layout.DONE_MARKER)
    has_done = storage.exists(done)
    if has_done and tags.holds_complete_checkpoint(storage, tag):
        resave.begin_resave(storage, tag)
        return time.time(), True
    # A new tag, the leftovers of an interrupted save of it, or a bare 'done' (optimum-neuron touches one before
    # its async save): rewritten in place.
    if has_done:
        storage.delete(done)
    storage.delete(metadata_path(tag))
    integrity.remove_manifests(storage, tag)  # stale ones (e.g. another world size) would fail verify
    storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
    return time.time(), False


def names_tag(names: Sequence[str], tag: str) -> bool:
    """Whether the checkpoint directory's ``names`` hold ``tag`` or a re-save of it (a deletion may be at work)."""
    return any(name in names for name in (tag, layout.RESAVE_PREFIX + tag, layout.REPLACED_PREFIX + tag))


def wait_for_deletions(pending: Sequence[Future], tag: str, timeout_s: float) -> None:
    """Wait for the deletions ``pending`` (their errors are the writer's to report) within the save's deadline."""
    _, running = concurrent.futures.wait(pending, timeout=timeout_s)
    if running:
        raise CheckpointTimeoutError(
            f"saving {tag!r}: deletions queued by earlier saves were still running after {timeout_s:g} s "
            "(slow or stalled storage); the tag was not touched"
        )


# ---------------------------------------------------------------------------------------------------- write
def open_target(
    root: Storage,
    tag: str,
    *,
    rank: int,
    world_size: int,
    created_at: float,
    resaved: bool,
    durable: bool,
    timeout_s: float | None,
    topology: Topology,
    zero1: bool,
    use_xser: bool,
    items: tuple[str, ...],
    saved_async: bool | None,
    sharding: ShardingRecord | None,
) -> CommitTarget:
    """The commit of ``tag`` in the checkpoint directory ``root`` (``prepare_tag`` said whether it is
    ``resaved``), and the storage its writers write through: the re-save's hidden directory under the tag's
    names, every write seen by a watchdog of ``timeout_s``, every file checksummed for the rank's manifest."""
    written = resave.ResaveStorage(root, tag) if resaved else root
    monitor = StorageMonitor(f"writing {tag!r} on rank {rank}", timeout_s, url=root.url)
    return CommitTarget(
        storage=integrity.ChecksummingStorage(WatchedStorage(written, monitor), tag, rank),
        tag=tag,
        created_at=created_at,
        topology=topology,
        world_size=world_size,
        zero1=zero1,
        use_xser=use_xser,
        items=items,
        saved_async=saved_async,
        monitor=monitor,
        sharding=sharding,
        resave_of=root if resaved else None,
        durable=durable,
        root=root,
    )


# ---------------------------------------------------------------------------------------------------- end
def open_barrier(
    store: Any | None, session: str, seq: int, rank: int, world_size: int, timeout_s: float | None, tag: str
) -> CommitBarrier:
    """The commit barrier of save number ``seq`` of this manager's ``session`` (its store transport)."""
    return CommitBarrier(store, session, seq, rank, world_size, timeout_s, tag)


def write_done(target: CommitTarget) -> None:
    """Rank 0, every rank's files being durable: metadata, rank 0's manifest again, then ``done`` (durably)."""
    storage = target.storage
    write_metadata(storage, target.metadata())
    storage.write_manifest()  # rank 0's manifest again, now listing the metadata file too
    storage.sync_dirs([target.tag, ""])  # the tag's entries are durable before 'done' can be
    storage.write_bytes(layout.tag_path(target.tag, layout.DONE_MARKER), b"1")
    storage.sync_dirs([target.tag])  # 'done' is durable before retention deletes older tags
    if target.resave_of is not None:  # the complete re-save takes the tag's name from the old checkpoint
        resave.swap_in_resave(target.resave_of, target.tag)
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
