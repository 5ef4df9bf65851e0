"""The atomic commit, in one owner for both front ends: how a save begins a tag, where its writers write, and how
it ends, the completion marker last and the same outcome on every rank. NxD tags (``done`` last) come through the
entry points below; DCP folders (``dcp/writer.py``: ``.metadata`` last) through ``prepare_folder``,
``staged_storage`` and ``complete_folder``, which the NxD path shares (``layout.CommitLayout``: each one's names).

  begin   ``prepare_tag`` (rank 0, before anything is written): the ``checkpoint`` marker on a new tag, or a
          re-save beside a complete one (``format.resave``: the old copy stays loadable until the new one is
          complete), after the deletions still running on the tag's name (``wait_for_deletions``);
  write   ``open_target``: the storage the writers write the tag through (the re-save's hidden directory under
          the tag's names, every write seen by the watchdog, every file checksummed for the rank's manifest);
  end     ``commit`` over the commit barrier (``barrier.CommitBarrier``, its store transport: ``open_barrier``)
          on every rank: each rank arrives (with its error, if any); rank 0 waits for all, writes the tag's
          metadata and ``done`` last (``write_done``: only if nobody failed; ``complete_folder``: the marker
          last, durably, then a re-save swapped in), records the tag in the root's index, and publishes the
          outcome, which every other rank waits for. Every rank then raises the same failure, or none.

Retention comes after, in ``format.retention``. Recovery of a save a crash interrupted is
``format.resave.recover_resave`` (``prepare_tag`` and ``prepare_folder`` run it first).
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

from nxd_ckpt.errors import CheckpointError, CheckpointTimeoutError
from nxd_ckpt.format import integrity, layout, resave, tags
from nxd_ckpt.format.layout import NXD_COMMIT, CommitLayout
from nxd_ckpt.format.metadata import TagMetadata, metadata_path, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.ranks.failures import RankFailure, mark_origin
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.storage import Storage
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage, run_watched

logger = logging.getLogger("nxd_ckpt")


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
@dataclass(frozen=True)
class CommitTarget:
    """What rank 0's commit writes: where, and the tag's metadata (the facts of this save)."""

    storage: Storage
    """The checkpoint directory (checksumming and watched: rank 0's manifest lists the metadata file too)."""
    metadata: TagMetadata
    """The tag's ``nxd_ckpt.json``: layout, encoding, contents and sharding of this save (its one owner)."""
    topology: Topology
    """The save's parallel layout (the metadata records its sizes; the plan needs the groups)."""
    monitor: StorageMonitor
    """The watchdog of this rank's writes, reset for the commit."""
    root: Storage | None
    """The checkpoint directory itself (unwrapped): where a re-save is swapped in and ``done`` recorded in the
    root's tag index; None for a save to the memory tier only (the checkpoint directory gets no ``done``)."""
    resaved: bool = False
    """The tag already held a complete checkpoint: the save is written beside it and swapped in."""

    @property
    def durable(self) -> bool:
        """Whether the save reaches the checkpoint directory (a save to the memory tier only does not)."""
        return self.root is not None

    @property
    def tag(self) -> str:
        """The tag being saved."""
        return self.metadata.tag

    @property
    def created_at(self) -> float:
        """When the save began (its order among the tags)."""
        assert self.metadata.created_at is not None
        return self.metadata.created_at

    @property
    def zero1(self) -> bool:
        """Whether the optimizer state is saved as ZeRO-1 shards."""
        return self.metadata.zero1


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
    written = staged_storage(root, tag, resaved)
    monitor = StorageMonitor(f"writing {tag!r} on rank {rank}", timeout_s, url=root.url)
    metadata = TagMetadata(
        tag=tag, created_at=created_at, tp=topology.tp_size, pp=topology.pp_size, dp=topology.dp_size,
        cp=topology.cp_size, ep=topology.ep_size, world_size=world_size, zero1=zero1,
        zero1_dp_size=topology.zero1_size if zero1 else None, xser=use_xser, saved_async=saved_async, items=items,
        torch_version=torch.__version__, sharding=sharding,
    )  # fmt: skip
    return CommitTarget(
        storage=integrity.ChecksummingStorage(WatchedStorage(written, monitor), tag, rank),
        metadata=metadata,
        topology=topology,
        monitor=monitor,
        root=root if durable else None,
        resaved=resaved,
    )


def staged_storage(root: Storage, folder: str, staged: bool, spec: CommitLayout = NXD_COMMIT) -> Storage:
    """The storage a save's writers write ``folder`` through: where it is ``staged``, its staging directory under
    the folder's names (so every writer names files as they are once committed), else ``root`` itself."""
    return resave.ResaveStorage(root, folder, spec.staging_dir(folder)) if staged else root


# ---------------------------------------------------------------------------------------------------- end
def open_barrier(
    store: Any | None, session: str, seq: int, rank: int, world_size: int, timeout_s: float | None, tag: str
) -> CommitBarrier:
    """The commit barrier of save number ``seq`` of this manager's ``session`` (its store transport)."""
    return CommitBarrier(store, session, seq, rank, world_size, timeout_s, tag)


def write_done(target: CommitTarget) -> None:
    """Rank 0, every rank's files being durable: metadata, rank 0's manifest again, then ``done`` (durably)."""
    storage = target.storage
    write_metadata(storage, target.metadata)
    storage.write_manifest()  # rank 0's manifest again, now listing the metadata file too
    assert target.root is not None  # only a durable save writes 'done'
    complete_folder(storage, target.tag, b"1", target.root if target.resaved else None)
    tags.record_committed(target.root, target.tag, target.created_at)  # after 'done', never before


def complete_folder(
    storage: Storage, folder: str, marker: bytes, swap_in: Storage | None, spec: CommitLayout = NXD_COMMIT
) -> None:
    """The coordinator, every file of the save durable: the completion marker (``spec.marker``, holding ``marker``)
    written last, atomically and durably; then a staged save (in ``swap_in``, its root) takes the folder's name."""
    storage.sync_dirs([folder, ""])  # the folder's entries are durable before the marker can be
    storage.write_bytes(f"{folder}/{spec.marker}", marker)
    storage.sync_dirs([folder])  # the marker is durable before retention deletes older checkpoints
    if swap_in is not None:  # the complete save takes the folder's name from the old checkpoint
        resave.swap_in_resave(swap_in, folder, spec)


def prepare_folder(root: Storage, folder: str, path: str, spec: CommitLayout) -> bool:
    """Coordinator, before any rank writes ``folder`` (``path``, as the caller named it) of a front end whose
    folders are only ever replaced whole (DCP: stock readers run no recovery): settle a killed save of it, then
    start an empty staging directory where ``root`` renames directories (True: the save is staged); elsewhere the
    folder is written in place, and a complete one is refused rather than overwritten."""
    recover_folder(root, folder, spec)
    if root.renames_dirs:
        resave.begin_resave(root, folder, spec)
        return True
    if root.exists(f"{folder}/{spec.marker}"):
        raise CheckpointError(
            f"{path} already holds a complete {spec.kind} and {root.url} cannot rename directories, so "
            "overwriting it could lose it if the save fails; save to a new folder or delete the old one first"
        )
    root.delete_tree(folder)
    return False


def recover_folder(root: Storage, folder: str, spec: CommitLayout) -> None:
    """Settle what a killed save of ``folder`` left, outside a save (``prepare_folder`` does it first): a complete
    save waiting beside it takes its name, else an old copy whose replacement never arrived goes back; every hidden
    copy is deleted (the marker first)."""
    resave.recover_resave(root, folder, spec)


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
