"""The steps of one save, in the order the data takes them: begin → plan → stage → write → commit → retention.

``SavePipeline.run`` composes them; each is a method or function testable alone (``testing.threadworld`` runs
the whole pipeline in one process with one thread per rank).

  begin      every rank's layout is checked; rank 0 marks the tag as being saved (a complete one is re-saved
             beside it) and every rank learns the save's identity (``SaveContext``);
  plan       which state files this rank writes (``plan.plan_save``) and its per-rank state files;
  stage      a training-safe host copy (async: ``staging.StagingPool``) or a thread fetching device tensors
             ahead of the writers (sync); the only step an async save blocks on besides ``begin``;
  write      this rank's files, durable, with its manifest (or into the memory tier, its peers, and every
             ``durable_every``-th time the checkpoint directory), watched for stalls;
  commit     ``commit.commit``: ranks arrive on the c10d store, rank 0 writes metadata and ``done`` last;
  retention  rank 0, a writer job after the commit: what ``num_kept_ckpts`` no longer keeps is deleted.

Steps write and commit use no collectives, so an async save runs them as one job on the writer thread. A
rank that fails before writing still arrives (with its error), so rank 0's commit never waits for it in vain.
The per-process state these steps need (coordinator, writer thread, staging pool, tier run-time, the save
counter) belongs to the manager and is lent through ``SaveServices``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from nxd_ckpt import adapters, statefile, tree
from nxd_ckpt import rank_state as rank_states
from nxd_ckpt.device.backend import on_device
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.format import integrity, layout, retention, sharding, tags
from nxd_ckpt.format.metadata import metadata_path, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import budget, commit, plan, staging
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.save.commit import CommitTarget
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.save.writer import AsyncWriter
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.runtime import TierRuntime, TierSave
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage, run_watched

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class SaveServices:
    """What the manager lends a save: its per-process state, as values and callbacks."""

    coordinator: Coordinator
    session: str
    """The store namespace of this manager's commits (identical on every rank)."""
    topology: Callable[[], Topology]
    storage_for: Callable[[Any], Storage]
    staging_pool: staging.StagingPool
    writer: Callable[[], AsyncWriter]
    """The background writer thread (started on first use)."""
    next_seq: Callable[[], int]
    """The number of the next save of this manager (identical on every rank)."""
    tier_runtime: Callable[[MemoryTier, str, Topology], TierRuntime]
    """The memory tier's run-time state for a checkpoint directory (set up collectively on first use)."""
    on_background_failure: Callable[[str], None]
    """An async save failed under ``on_save_error="warn"``: reported by the next save's SaveReport."""
    on_retention_queued: Callable[[Future], None]


@dataclass(frozen=True)
class SaveContext:
    """One save as every step sees it: its options, identity and where its files go."""

    options: SaveOptions
    commit: CommitTarget
    """Rank 0's commit: the checkpoint directory (checksumming, watched) and the tag's metadata."""
    seq: int
    coordinator: Coordinator
    session: str
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
        coord = self.coordinator
        return CommitBarrier(
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
    fetcher: DeviceTransfer | budget.BudgetedStager | None = None
    """Device tensors: their host copies, arriving on a background thread ahead of the writers (from the device
    snapshot of an async save, from the live tensors of a sync one); async saves under a host memory budget: the
    copies the training thread makes in ``run`` while the writer writes."""

    def host(self) -> Callable[[Any], Any] | None:
        return self.fetcher.host if self.fetcher is not None else None


class SavePipeline:
    """The steps of one save on one rank, over the services the manager lends."""

    def __init__(self, services: SaveServices) -> None:
        self.services = services
        self.coord = services.coordinator

    # ------------------------------------------------------------------ composition
    def run(self, options: SaveOptions, report: SaveReport) -> None:
        """Save ``options`` on this rank (every rank calls it); async saves return once staged."""
        coord = self.coord
        if report.waited_s >= 0.001 and coord.rank == 0:
            logger.info("save of %s waited %.2f s for the previous save to finish writing", options.tag,
                        report.waited_s)  # fmt: skip
        topo = coord.run_all(self.services.topology, f"starting checkpoint {options.tag!r}")  # checked everywhere
        storage = self.services.storage_for(options.checkpoint_dir)
        # Per-rank state (data loaders, RNG) is captured first: in "gather" mode this is a collective.
        rank_files = rank_states.stage_for_save(
            coord, topo, options.tag, options.rank_state, save_rng=options.save_rng, mode=options.rank_state_mode,
            copy_state=options.async_save,
        )  # fmt: skip
        model_sd = adapters.model_state(options.model) if options.model is not None else None
        share = sharding_share(coord, topo, options, model_sd) if options.model is not None else None
        runtime = self.services.tier_runtime(options.memory_tier, storage.url, topo) if options.memory_tier else None
        durable = runtime.count_save() if runtime is not None else True
        ctx = self.begin(options, storage, topo, share, durable)
        report.checkpoint_dir = storage.url
        stage_start = time.perf_counter()
        writes = plan_writes(ctx, model_sd)
        if runtime is not None:
            ctx = self.enter_tier(ctx, runtime, writes)
        staged = self.stage(ctx, writes, report)
        staged.writes += [plan.StateWrite("rank_state", path, state, (coord.rank,)) for path, state in rank_files]
        report.staging_s = time.perf_counter() - stage_start
        if options.async_save:
            report.blocked_s = time.perf_counter() - report._started  # set first: the job logs it
            job = self.services.writer().submit(lambda: self.background_job(ctx, staged, report), f"save {ctx.tag}")
            report._future = job
            if isinstance(staged.fetcher, budget.BudgetedStager):  # copies what fits, waits for the rest
                staged.fetcher.stage()
                report.budget_wait_s = staged.fetcher.waited_s
                report.staging_s = time.perf_counter() - stage_start
        else:
            self.write_and_commit(ctx, staged, report, waves=options.num_workers)
        # Deletions go to the writer thread, after 'done' (the commit): the training thread never waits for them.
        self.queue_retention(ctx, report)
        report.blocked_s = time.perf_counter() - report._started
        if not options.async_save:
            log_save(report, coord)

    # ------------------------------------------------------------------ begin
    def begin(
        self, options: SaveOptions, storage: Storage, topo: Topology, share: ShardingShare, durable: bool
    ) -> SaveContext:
        """Rank 0 marks the tag as being saved (a complete one is re-saved beside it) and receives every rank's
        ``share`` of the sharding record; all ranks agree on the save: one world-wide step. A save to the memory
        tier only (``durable`` False) leaves the checkpoint directory alone."""
        coord, tag = self.coord, options.tag
        shares, (created_at, resave) = coord.gather_to_master_and_master_computes(
            share,
            lambda: prepare_tag(storage, tag, durable) if coord.rank == 0 else (0.0, False),
            f"starting checkpoint {tag!r}",
        )
        record = merge_sharding(shares) if shares is not None and options.model is not None else None
        seq = self.services.next_seq()
        target = tags.ResaveStorage(storage, tag) if resave else storage
        monitor = StorageMonitor(f"writing {tag!r} on rank {coord.rank}", options.timeout_s, url=storage.url)
        commit_target = CommitTarget(
            # records checksums for the manifest, over a storage whose every write the watchdog sees
            storage=integrity.ChecksummingStorage(WatchedStorage(target, monitor), tag, coord.rank),
            tag=tag,
            created_at=created_at,
            topology=topo,
            world_size=coord.world_size,
            zero1=bool(options.zero1_optimizer) or adapters.is_zero1_optimizer(options.optimizer),
            use_xser=options.use_xser,
            items=options.items,
            monitor=monitor,
            sharding=record,
            resave_of=storage if resave else None,
            durable=durable,
            root=storage,
        )
        return SaveContext(options, commit_target, seq, coord, self.services.session)

    def enter_tier(self, ctx: SaveContext, runtime: TierRuntime, writes: list[plan.StateWrite]) -> SaveContext:
        """Before staging: a node that cannot hold the save fails it here, on every rank."""
        coord = self.coord
        rank_bytes = sum(t.numel() * t.element_size() for t in plan.tensors_to_write(writes, coord.rank))
        with ctx.arrive_on_failure():
            coord.run_all(lambda: runtime.check_budget(ctx.tag, rank_bytes), "memory tier: checking the budget")
        tier = runtime.begin_save(ctx.tag, ctx.commit.created_at, coord.world_size, ctx.monitor)
        return replace(ctx, tier=tier)

    # ------------------------------------------------------------------ stage
    def stage(self, ctx: SaveContext, writes: list[plan.StateWrite], report: SaveReport) -> Staged:
        """Async: a training-safe copy in reused host buffers, handed back once the files are durable. Sync:
        device tensors are copied to the host by a thread running ahead of the writers (one sync for all)."""
        rank = self.coord.rank
        with ctx.arrive_on_failure():
            if ctx.options.async_save and ctx.options.budget_bytes is not None:  # staged in pieces by ``run``
                stager = budget.BudgetedStager(
                    plan.tensors_to_write(writes, rank), ctx.options.budget_bytes, ctx.options.timeout_s
                )
                stager.watch(ctx.storage)  # a written file frees the copies it was written from
                if ctx.tier is not None:
                    stager.watch(ctx.tier.storage)
                return Staged(list(writes), fetcher=stager)
            if ctx.options.async_save:
                needed = {id(t) for t in plan.tensors_to_write(writes, rank)}
                lease = self.services.staging_pool.stage(
                    [w.state for w in writes], needed=needed, device_budget=ctx.options.device_budget
                )
                report.staging_allocated_bytes = lease.allocated_bytes
                if lease.snapshot is not None:
                    report.device_snapshot_bytes = lease.snapshot.snapshot_bytes
                    report.device_direct_bytes = lease.snapshot.direct_bytes
                    report.device_direct_s = lease.snapshot.direct_s
                    report.device_budget_bytes = lease.snapshot.budget_bytes
                staged = [w.with_state(state) for w, state in zip(writes, lease.trees, strict=True)]
                return Staged(staged, lease=lease, fetcher=lease.transfer)
            device = list({id(t): t for t in plan.tensors_to_write(writes, rank) if on_device(t)}.values())
            if device:  # training is blocked in the call: the live tensors are the sources
                return Staged(list(writes), fetcher=DeviceTransfer(device, device))
            return Staged(list(writes))

    # ------------------------------------------------------------------ write + commit
    def background_job(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
        """An async save's writer job: write and commit; under ``on_save_error="warn"`` a failure is logged
        and reported by the next save instead of raised by it."""
        try:
            self.write_and_commit(ctx, staged, report, waves=None)
        except Exception as e:
            if ctx.options.on_save_error == "raise":
                raise
            warn_failed(report, e)
            self.services.on_background_failure(f"{ctx.tag}: {report.error}")
            return
        log_save(report, self.coord)

    def write_and_commit(self, ctx: SaveContext, staged: Staged, report: SaveReport, waves: int | None) -> None:
        """Write this rank's files, then run the commit. ``waves`` bounds concurrent writers per host for
        synchronous saves (it uses barriers); background writes pass None (no collectives)."""
        coord, topo = self.coord, ctx.commit.topology
        write_start = time.perf_counter()
        error: BaseException | None = None
        try:
            if waves is not None and coord.distributed and waves < topo.local_world_size:
                what = f"writing {ctx.tag!r}"
                write = lambda: self.write(ctx, staged, report)  # noqa: E731
                # no world-wide step after the waves: the commit right after carries the failures
                coord.in_waves(waves, topo.local_rank, topo.local_world_size, write, what, check=False)
            else:
                self.write(ctx, staged, report)
        except BaseException as e:
            error = e
        report.write_s = time.perf_counter() - write_start
        if staged.fetcher is not None:
            try:  # an unseen transfer error fails this rank's write, before it arrives
                staged.fetcher.close()
            except BaseException as e:
                error = error or e
            if isinstance(staged.fetcher, DeviceTransfer) and ctx.options.async_save:
                report.staging_allocated_bytes += staged.fetcher.allocated_bytes  # pinned on the transfer thread
        if staged.lease is not None:
            staged.lease.release()
            if ctx.monitor.cancelled:  # an abandoned writer thread may still read them: never reuse them
                self.services.staging_pool.clear()
        try:
            commit.commit(ctx.barrier(), ctx.commit, coord.rank, error)
        finally:
            report.total_s = time.perf_counter() - report._started
        report.completed = True

    def write(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
        """This rank's files, on a helper thread watched for stalls and overdue files: a storage call that never
        returns raises here (naming the file and the bytes moved) instead of hanging this rank."""
        ctx.monitor.reset(f"writing {ctx.tag!r} on rank {self.coord.rank}")
        if ctx.tier is not None:
            run_watched(lambda: self.write_tiers(ctx, ctx.tier, staged, report), ctx.monitor)
        else:
            run_watched(lambda: self.write_durable(ctx, staged, report), ctx.monitor)

    def write_durable(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
        """The checkpoint directory: every file fsynced in one batch at the end, then the rank's manifest."""
        storage = ctx.storage
        with storage.durability_batch():
            written = write_files(storage, staged, self.coord.rank, report)
        storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
        storage.write_manifest()  # before arriving: 'done' implies every rank's manifest exists
        report.files_written = len(written)

    def write_tiers(self, ctx: SaveContext, tier: TierSave, staged: Staged, report: SaveReport) -> None:
        """Node memory first (the copy every other tier is made from), then the peers, then durable storage."""
        tier.begin()
        written = write_files(tier.storage, staged, self.coord.rank, report)
        if self.coord.rank == 0:  # the metadata a restore from memory needs (durable storage gets it at 'done')
            write_metadata(tier.storage, ctx.commit.metadata())
        tier.seal()
        if staged.lease is not None:  # the state is in node memory: the staging buffers can be reused
            staged.lease.release()
        tier.replicate()
        if ctx.commit.durable:
            tier.copy_to(ctx.storage)
            ctx.storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
            ctx.storage.write_manifest()
        report.files_written = len(written)

    # ------------------------------------------------------------------ retention
    def queue_retention(self, ctx: SaveContext, report: SaveReport) -> None:
        """Rank 0: retention as a writer job behind the save (it runs only if the save was committed)."""
        kept = ctx.options.kept_ckpts
        if self.coord.rank != 0 or kept is None or not ctx.commit.durable:
            return

        def after_commit() -> None:
            if report.completed:
                retention.apply_retention(ctx.storage, ctx.options.retention, protect={ctx.tag})

        self.services.on_retention_queued(self.services.writer().submit(after_commit, f"retention after {ctx.tag}"))


# ---------------------------------------------------------------------- steps as functions
def prepare_tag(storage: Storage, tag: str, durable: bool) -> tuple[float, bool]:
    """Rank 0, before anything is written: the save's creation time, and whether it re-saves a complete tag
    (written beside it and swapped in when complete, so the old one stays loadable until then)."""
    if not durable:
        return time.time(), False
    tags.recover_resaves(storage)  # a re-save a crash interrupted is finished or dropped first
    done = layout.tag_path(tag, layout.DONE_MARKER)
    has_done = storage.exists(done)
    if has_done and tags.holds_complete_checkpoint(storage, tag):
        tags.begin_resave(storage, tag)
        return time.time(), True
    # A new tag, the leftovers of an interrupted save of it, or a bare 'done' (optimum-neuron touches one before
    # its async save): rewritten in place.
    if has_done:
        storage.delete(done)
    storage.delete(metadata_path(tag))
    integrity.remove_manifests(storage, tag)  # stale ones (e.g. another world size) would fail verify
    storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
    return time.time(), False


def plan_writes(ctx: SaveContext, model_sd: Any) -> list[plan.StateWrite]:
    """The state files this rank writes, over the state as NxD's containers hold it."""
    options = ctx.options
    optimizer = adapters.optimizer_state(options.optimizer) if options.optimizer is not None else None
    return plan.plan_save(
        ctx.commit.topology,
        ctx.tag,
        model=model_sd,
        optimizer=tree.nxd_containers(optimizer) if optimizer is not None else None,
        scheduler=adapters.scheduler_state(options.scheduler) if options.scheduler is not None else None,
        user_content=options.user_content,
        zero1=ctx.commit.zero1,
        use_xser=options.use_xser,
    )


def write_files(target: Storage, staged: Staged, rank: int, report: SaveReport) -> list[str]:
    """Every staged write into ``target``; the paths written (tensor bytes are added to the report)."""
    written: list[str] = []
    host = staged.host()
    for w in staged.writes:
        if w.is_state_file:
            done = statefile.write_state_file(
                target, w.path, w.state, xser_encoding=w.xser, replicas=w.replicas, rank=rank, host=host
            )
            written += done.paths
            report.bytes_written += done.nbytes
        else:
            written += statefile.write_plain(target, w.path, w.state, host=host)
            report.bytes_written += tree.tensor_bytes(w.state)
    return written


ShardingShare: TypeAlias = "ShardingRecord | str | None"
"""What one rank contributes to the sharding record: its stage's record, the error that kept it from one (as
text), or None (ranks other than each stage's first replica of TP rank 0)."""


def sharding_share(coord: Coordinator, topo: Topology, options: SaveOptions, model_sd: Any) -> ShardingShare:
    """This rank's share of the sharding record: each stage's first replica of TP rank 0 describes its stage.
    Never raises: a save must not fail (or leave the others waiting) over the record."""
    if topo.tp_rank != 0 or topo.replica_rank != 0:
        return None
    try:
        return sharding.record_for_save(options.model, model_sd, options.optimizer, topo.tp_size, topo.pp_rank)
    except Exception as e:
        return f"rank {coord.rank}: {e}"


def merge_sharding(shares: list[ShardingShare]) -> ShardingRecord | None:
    """Rank 0: how every model tensor of every PP stage is sharded, from every rank's share. None, with a
    warning, when it cannot be recorded (the checkpoint is then still saved, only not re-shardable without a
    sharding spec)."""
    problems = [g for g in shares if isinstance(g, str)]
    try:
        if problems:
            raise ValueError("; ".join(problems))
        merged = ShardingRecord.merge(g for g in shares if isinstance(g, ShardingRecord))
        return merged if merged.tensors else None  # e.g. a dict at TP > 1: nothing known, nothing recorded
    except Exception as e:
        logger.warning(
            "the sharding of the model could not be recorded (%s): loads at another layout will need sharding=", e
        )
        return None


def refuse_unsavable(options: SaveOptions) -> None:
    """Before any collective or file: a model without data (meta tensors) fails here, on every rank."""
    if options.model is not None:
        adapters.refuse_meta_for_save(adapters.model_state(options.model), "model")


def warn_failed(report: SaveReport, error: BaseException) -> None:
    """``on_save_error="warn"``: log the failure (on every rank) and record it instead of raising."""
    report.record_failure(error)
    logger.error(
        "checkpoint %s in %s FAILED and training continues (on_save_error='warn'); the previous complete "
        "checkpoint stays the latest: %s",
        report.tag,
        report.checkpoint_dir,
        report.error,
    )


def log_save(report: SaveReport, coord: Coordinator) -> None:
    """One INFO line per save, on the master rank (async saves: when the commit outcome is known)."""
    if coord.rank == 0:
        logger.info("%s", report.summary())
