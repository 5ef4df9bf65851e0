"""The steps of one save, in the order the data takes them: begin → plan → stage → write → commit → retention.

``SavePipeline.run`` composes them; each is a method or function testable alone (``testing.threadworld`` runs
the whole pipeline in one process with one thread per rank).

  begin      every rank's layout is checked; the per-rank state (data loaders, RNG) and the model's state dict
             are captured as they are at the call (the per-rank state gathered to rank 0 in "gather" mode);
             rank 0 marks the tag as being saved (a complete one is re-saved beside it) and every rank learns the
             save's identity (``SaveContext``);
  plan       every file this rank writes, one value (``plan.SavePlan``): its state files (``plan.plan_save``),
             then its per-rank state files;
  stage      every copy, by one strategy: pooled (async: a training-safe host copy in ``staging.StagingPool``,
             then the write is handed to the writer thread), budgeted (async under a host memory budget: the
             write is handed over first and the call copies what fits the budget while it writes, waiting for
             the rest: ``budget.BudgetedStager``), or live (sync: a thread fetching device tensors ahead of the
             writers); the only step an async save blocks on besides ``begin`` and ``plan``;
  write      this rank's files, durable, with its manifest (or into the memory tier, its peers, and every
             ``durable_every``-th time the checkpoint directory), watched for stalls;
  commit     ``commit.commit``: ranks arrive on the c10d store, rank 0 writes metadata and ``done`` last;
  retention  rank 0, a writer job after the commit: what ``num_kept_ckpts`` no longer keeps is deleted.

Steps write and commit use no collectives, so an async save runs them as one job on the writer thread. A
rank that fails before writing still arrives (with its error), so rank 0's commit never waits for it in vain.
The manager hands a save its per-process objects and this call's number and clock (``SaveServices``); the
save hands back what the manager keeps (``SaveOutcome``: the sequence number it used, its writer jobs, the
error to raise). The pipeline alone fills in the ``SaveReport``, reading every duration off one ``SaveTimer``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeAlias

import torch

from nxd_ckpt import adapters, knobs, statefile, tree
from nxd_ckpt import rank_state as rank_states
from nxd_ckpt.device import kept_budget
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import distinct_storages, native_device, on_device
from nxd_ckpt.device.transfer import DeviceTransfer, run_on_transfer_thread
from nxd_ckpt.errors import CheckpointTimeoutError
from nxd_ckpt.format import integrity, layout, retention, sharding_marks, tags
from nxd_ckpt.format.metadata import metadata_path, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.deadlines import Deadline
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import budget, commit, plan
from nxd_ckpt.save.commit import CommitTarget
from nxd_ckpt.save.context import Captured, SaveContext, SaveOutcome, SaveServices, Staged
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.runtime import TierRuntime, TierSave
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage, run_watched

logger = logging.getLogger("nxd_ckpt")


class SavePipeline:
    """The steps of one save on one rank, over what the manager hands it."""

    def __init__(self, services: SaveServices) -> None:
        self.services = services
        self.coord = services.coordinator
        self.timer = services.timer
        self.job: Future[str | None] | None = None
        """Async saves: the write-and-commit job, once ``stage`` handed the write to the writer thread."""

    # ------------------------------------------------------------------ composition
    def run(self, options: SaveOptions, report: SaveReport) -> SaveOutcome:
        """Save ``options`` on this rank (every rank calls it); async saves return once staged. Never raises: the
        outcome carries the error to raise; under ``on_save_error="warn"`` a failure is logged and recorded in
        ``report`` instead."""
        ctx: SaveContext | None = None
        retention_job: Future | None = None
        try:
            ctx, captured = self.begin(options, report)
            stage_start = self.timer.now()
            planned = self.plan(ctx, captured)
            if ctx.runtime is not None:
                ctx = self.enter_tier(ctx, ctx.runtime, planned)
            staged = self.stage(ctx, planned, report, stage_start)
            if not options.async_save:
                self.write_and_commit(ctx, staged, report, waves=options.num_workers)
            # Deletions go to the writer thread, after 'done' (the commit): the training thread never waits for them.
            retention_job = self.queue_retention(ctx, report)
            report.blocked_s = self.timer.since()
            if not options.async_save:
                log_save(report, self.coord)
        except Exception as e:
            if options.on_save_error == "raise":
                return self.outcome(ctx, retention_job, e)
            warn_failed(report, e)
            report.blocked_s = self.timer.since()
        except BaseException as e:
            return self.outcome(ctx, retention_job, e)
        return self.outcome(ctx, retention_job)

    def outcome(
        self, ctx: SaveContext | None, retention_job: Future | None, error: BaseException | None = None
    ) -> SaveOutcome:
        """What ``run`` hands back (returned from inside its ``except``, so that no frame of the error's traceback
        keeps the error itself alive)."""
        return SaveOutcome(ctx.seq if ctx is not None else None, self.job, retention_job, error)

    # ------------------------------------------------------------------ begin
    def begin(self, options: SaveOptions, report: SaveReport) -> tuple[SaveContext, Captured]:
        """Every rank's layout, checked; the state read from the live objects (``capture``); the save counted by
        the memory tier; then the tag marked and the save agreed on (``mark_tag``)."""
        coord = self.coord
        if report.waited_s >= 0.001 and coord.rank == 0:
            logger.info("save of %s waited %.2f s for the previous save to finish writing", options.tag,
                        report.waited_s)  # fmt: skip
        topo = coord.run_all(self.services.topology, f"starting checkpoint {options.tag!r}")  # checked everywhere
        storage = self.services.storage_for(options.checkpoint_dir)
        captured = capture(coord, topo, options)
        share = sharding_share(coord, topo, options, captured.model) if options.model is not None else None
        runtime = self.services.tier_runtime(options.memory_tier, storage.url, topo) if options.memory_tier else None
        durable = runtime.count_save() if runtime is not None else True
        ctx = self.mark_tag(options, storage, topo, share, durable, runtime, self.budget_proposal(options, captured))
        report.checkpoint_dir = storage.url
        return ctx, captured

    def budget_proposal(self, options: SaveOptions, captured: Captured) -> int | None:
        """An async save's proposal of a device snapshot budget for the model's and optimizer's device state (the
        kept one: ``kept_budget``); None without device state, or for a sync save. Never raises (it runs before
        the collective the others wait in): a state it cannot size fails the save in ``stage``, on every rank."""
        if not options.async_save:
            return None
        try:
            optimizer = adapters.optimizer_state(options.optimizer) if options.optimizer is not None else None
            state = kept_budget.device_tensors(t for t in (captured.model, optimizer) if t is not None)
            return self.services.device_budget.proposal(options.device_budget, state) if state else None
        except Exception:
            return None

    def mark_tag(
        self,
        options: SaveOptions,
        storage: Storage,
        topo: Topology,
        share: ShardingShare,
        durable: bool,
        runtime: TierRuntime | None = None,
        budget_proposal: int | None = None,
    ) -> SaveContext:
        """Rank 0 marks the tag as being saved (a complete one is re-saved beside it) and receives every rank's
        ``share`` of the sharding record; all ranks agree on the save and on the device snapshot budget (the least
        of the ranks' ``budget_proposal``, kept for the next saves): one world-wide step. A save to the memory
        tier only (``durable`` False) leaves the checkpoint directory alone."""
        coord, tag = self.coord, options.tag
        shares, ((created_at, resave), agreed) = coord.gather_to_master_and_master_computes(
            (share, budget_proposal),
            lambda: (
                prepare_tag(storage, tag, durable, self.services.pending_deletions, options.timeout_s)
                if coord.rank == 0
                else (0.0, False)
            ),
            f"starting checkpoint {tag!r}",
            agree=lambda gathered: kept_budget.agree([proposal for _, proposal in gathered]),
        )
        if budget_proposal is not None and agreed is not None:  # the snapshot of every rank is cut alike
            options = options.replace(device_snapshot_budget=self.services.device_budget.agree(agreed).bytes)
        shares = [s for s, _ in shares] if shares is not None else None
        record = merge_sharding(shares) if shares is not None and options.model is not None else None
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
            saved_async=options.async_save,
            monitor=monitor,
            sharding=record,
            resave_of=storage if resave else None,
            durable=durable,
            root=storage,
        )
        return SaveContext(options, commit_target, self.services.seq, coord, self.services.session, runtime)

    # ------------------------------------------------------------------ plan
    def plan(self, ctx: SaveContext, captured: Captured) -> plan.SavePlan:
        """Every file this rank writes: its state files, then the per-rank state files ``begin`` captured."""
        state_files = plan_writes(ctx, captured.model)
        return plan.SavePlan(tuple(state_files), plan.rank_state_writes(captured.rank_files, self.coord.rank))

    def enter_tier(self, ctx: SaveContext, runtime: TierRuntime, planned: plan.SavePlan) -> SaveContext:
        """Before staging: a node that cannot hold the save fails it here, on every rank."""
        coord = self.coord
        rank_bytes = sum(t.numel() * t.element_size() for t in plan.tensors_to_write(planned.state_files, coord.rank))
        with ctx.arrive_on_failure():
            coord.run_all(lambda: runtime.check_budget(ctx.tag, rank_bytes), "memory tier: checking the budget")
        tier = runtime.begin_save(ctx.tag, ctx.commit.created_at, coord.world_size, ctx.monitor)
        return replace(ctx, tier=tier)

    # ------------------------------------------------------------------ stage
    def stage(self, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport, stage_start: float) -> Staged:
        """Every copy of the save, by the strategy its options choose: budgeted (``stage_budgeted``), pooled
        (``stage_pooled``) or live (``stage_live``). An async save's write is handed to the writer thread here
        (``hand_off``); ``staging_s`` runs from ``stage_start`` (before ``plan``)."""
        options = ctx.options
        if options.async_save:
            self.services.writer.start()  # before any copy keeps the device (or the host) busy
        if options.async_save and options.budget_bytes is not None:
            return self.stage_budgeted(ctx, planned, report, stage_start)
        with ctx.arrive_on_failure():
            staged = self.stage_pooled(ctx, planned, report) if options.async_save else self.stage_live(ctx, planned)
        report.staging_s = self.timer.since(stage_start)
        if options.async_save:
            self.hand_off(ctx, staged, report)
        return staged

    def stage_pooled(self, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport) -> Staged:
        """Async: a training-safe copy of the state files in reused host buffers (device tensors: a copy on the
        device, brought to the host by a transfer thread), handed back once the files are written. The per-rank
        state files are copies already (``begin``)."""
        pool, files = self.services.staging_pool, planned.state_files
        needed = [id(t) for t in plan.tensors_to_write(files, self.coord.rank)]  # in the writers' order
        lease = pool.stage(
            [w.state for w in files],
            ctx.options.timeout_s,
            needed=needed,
            device_budget=ctx.options.device_budget,
            rank=self.coord.rank,
        )
        report.staging_allocated_bytes = lease.allocated_bytes
        if lease.snapshot is not None:
            report.device_snapshot_bytes = lease.snapshot.snapshot_bytes
            report.device_direct_bytes = lease.snapshot.direct_bytes
            report.device_direct_s = lease.snapshot.direct_s
            report.device_budget_bytes = lease.snapshot.budget_bytes
            self.after_fallback(report, lease.snapshot.fallback, lease.snapshot.snapshot_bytes)
        copies = [w.with_state(state) for w, state in zip(files, lease.trees, strict=True)]
        return Staged([*copies, *planned.rank_state_files], lease=lease, pool=pool, fetcher=lease.transfer)

    def stage_budgeted(
        self, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport, stage_start: float
    ) -> Staged:
        """Async under a host memory budget: the write is handed over first, reading live tensors where no copy
        exists yet; the call then copies what fits the budget ahead of the writer and returns once no file still
        needs a live tensor (``budget.BudgetedStager``)."""
        options = ctx.options
        with ctx.arrive_on_failure():
            tensors = plan.tensors_to_write(planned.state_files, self.coord.rank)
            device = list({id(t): t for t in tensors if on_device(t)}.values())
            copies = None
            if device:
                native = native_device(device)
                pool = self.services.staging_pool
                arena = pool.pinned_arena(options.budget_bytes, native.staging_empty) if native is not None else None
                copies = device_snapshot.copy_on_device(device, options.device_budget, arena)
            stager = budget.BudgetedStager(
                tensors,
                options.budget_bytes,
                options.timeout_s,
                frozen=copies.sources if copies is not None else None,
                fetch=copies.fetch if copies is not None else None,
                batch_bytes=knobs.xla_transfer_batch_bytes(),
                give_back=copies.give_back if copies is not None else None,
                room=copies.room if copies is not None else None,
                rank=self.coord.rank,
            )
            stager.watch(ctx.storage)  # a written file frees the copies it was written from
            if ctx.tier is not None:
                stager.watch(ctx.tier.storage)
        frozen = copies is not None and copies.snapshot_bytes > 0
        if copies is not None:
            copies.sources.clear()  # the stager holds the device copies now, and drops each once it is on the host
            report.device_snapshot_bytes = copies.snapshot_bytes
            report.device_direct_bytes = copies.direct_bytes
            report.device_budget_bytes = copies.budget_bytes
            self.after_fallback(report, copies.fallback, copies.snapshot_bytes)
        staged = Staged(planned.writes, fetcher=stager, pool=self.services.staging_pool)
        report.staging_s = self.timer.since(stage_start)
        if frozen:
            stager.begin_frozen()  # writers wait for the copies stage_frozen brings
        self.hand_off(ctx, staged, report)
        if frozen:
            run_on_transfer_thread(stager.stage_frozen)  # the device copies travel beside training, within the budget
        stager.stage()  # copies what fits, waits for the rest
        report.budget_wait_s = stager.waited_s
        report.staging_s = self.timer.since(stage_start)
        return staged

    def after_fallback(self, report: SaveReport, fallback: str | None, cloned_bytes: int) -> None:
        """A snapshot that ran out of device memory (``fallback``) is reported, warned about, and the kept budget
        shrinks (``KeptSnapshotBudget.shrink``) so that the next save does not run out again."""
        if fallback is None:
            return
        smaller = self.services.device_budget.shrink(cloned_bytes)
        report.device_snapshot_fallback = f"{fallback}; the next saves propose a budget of {smaller} bytes"
        logger.warning("checkpoint %s on rank %d: %s", report.tag, self.coord.rank, report.device_snapshot_fallback)

    def stage_live(self, ctx: SaveContext, planned: plan.SavePlan) -> Staged:
        """Sync: training is blocked in the call, so the live tensors are the sources; device tensors are copied
        to the host by a thread running ahead of the writers (one sync for all)."""
        tensors = plan.tensors_to_write(planned.state_files, self.coord.rank)
        device = list({id(t): t for t in tensors if on_device(t)}.values())
        if not device:
            return Staged(planned.writes)
        first, alias_of = distinct_storages(device)  # tied weights travel once; each key still gets its own copy
        moved = [device[i] for i in first]
        aliases = {id(device[j]): device[i] for j, i in alias_of.items()}
        deadline = Deadline(ctx.options.timeout_s, self.coord.rank)
        return Staged(planned.writes, fetcher=DeviceTransfer(moved, moved, aliases=aliases, deadline=deadline))

    def hand_off(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
        """Async: write and commit become one job on the writer thread (``self.job``), which ``report`` follows."""
        report.blocked_s = self.timer.since()  # set first: the job logs it
        self.job = self.services.writer.submit(lambda: self.background_job(ctx, staged, report), f"save {ctx.tag}")
        report.track(self.job)

    # ------------------------------------------------------------------ write + commit
    def background_job(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> str | None:
        """An async save's writer job: write and commit. Under ``on_save_error="warn"`` a failure is logged and
        returned (the next save reports it) instead of raised."""
        try:
            self.write_and_commit(ctx, staged, report, waves=None)
        except Exception as e:
            if ctx.options.on_save_error == "raise":
                raise
            warn_failed(report, e)
            return f"{ctx.tag}: {report.error}"
        log_save(report, self.coord)
        return None

    def write_and_commit(self, ctx: SaveContext, staged: Staged, report: SaveReport, waves: int | None) -> None:
        """Write this rank's files, then run the commit. ``waves`` bounds concurrent writers per host for
        synchronous saves (it uses barriers); background writes pass None (no collectives)."""
        coord, topo = self.coord, ctx.commit.topology
        write_start = self.timer.now()
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
        report.write_s = self.timer.since(write_start)
        fetch_error, pinned = staged.close(ctx.monitor)
        error = error or fetch_error
        report.staging_allocated_bytes += pinned
        if isinstance(staged.fetcher, budget.BudgetedStager):
            report.budget_peak_bytes = staged.fetcher.peak_bytes
            report.budget_copied_by_writers_bytes = staged.fetcher.copied_by_writers_bytes
            report.budget_overdrawn_bytes = staged.fetcher.overdrawn_bytes
        try:
            commit.commit(ctx.barrier(), ctx.commit, coord.rank, error)
        finally:
            report.total_s = self.timer.since()
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
            written = write_files(storage, staged, self.coord.rank, report, ctx.monitor)
        storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
        storage.write_manifest()  # before arriving: 'done' implies every rank's manifest exists
        report.files_written = len(written)

    def write_tiers(self, ctx: SaveContext, tier: TierSave, staged: Staged, report: SaveReport) -> None:
        """Node memory first (the copy every other tier is made from), then the peers, then durable storage."""
        tier.begin()
        written = write_files(tier.storage, staged, self.coord.rank, report, ctx.monitor)
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
    def queue_retention(self, ctx: SaveContext, report: SaveReport) -> Future | None:
        """Rank 0: retention as a writer job behind the save (it runs only if the save was committed); its
        Future, or None where no retention runs (other ranks, ``num_kept_ckpts`` unset, a memory-only save)."""
        policy = ctx.options.retention
        if self.coord.rank != 0 or policy is None or not ctx.commit.durable:
            return None

        def after_commit() -> None:
            if report.completed:
                retention.apply_retention(ctx.storage, policy, protect={ctx.tag})

        return self.services.writer.submit(after_commit, f"retention after {ctx.tag}")


# ---------------------------------------------------------------------- steps as functions
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


def capture(coord: Coordinator, topo: Topology, options: SaveOptions) -> Captured:
    """The state read from the live objects, first thing in a save: the per-rank state (a collective, a gather
    in "gather" mode; copied for async saves), then the model's state dict."""
    rank_files = rank_states.stage_for_save(
        coord, topo, options.tag, options.rank_state, save_rng=options.save_rng, mode=options.rank_state_mode,
        copy_state=options.async_save,
    )  # fmt: skip
    model_sd = adapters.model_state(options.model) if options.model is not None else None
    return Captured(model_sd, rank_files)


def plan_writes(ctx: SaveContext, model_sd: Any) -> list[plan.StateWrite]:
    """The state files this rank writes, over the state as NxD's containers hold it."""
    options = ctx.options
    return plan.plan_save(
        ctx.commit.topology,
        ctx.tag,
        model=model_sd,
        optimizer=_optimizer_tree(options.optimizer),
        scheduler=adapters.scheduler_state(options.scheduler) if options.scheduler is not None else None,
        user_content=options.user_content,
        zero1=ctx.commit.zero1,
        use_xser=options.use_xser,
    )


def planned_tensors(topo: Topology, model: Any, optimizer: Any, *, use_xser: bool, zero1: bool) -> list[torch.Tensor]:
    """The tensors an async save of ``model``/``optimizer`` with these options stages on this rank (its share of
    xser files among DP replicas, nothing of a plain file another replica writes), by the save's own plan."""
    writes = plan.plan_save(
        topo,
        "planned",
        model=adapters.model_state(model) if model is not None else None,
        optimizer=_optimizer_tree(optimizer),
        zero1=zero1,
        use_xser=use_xser,
    )
    return plan.tensors_to_write(writes, topo.rank)


def _optimizer_tree(optimizer: Any) -> Any:
    """The optimizer's state as a save plans it (NxD's containers), or None."""
    return tree.nxd_containers(adapters.optimizer_state(optimizer)) if optimizer is not None else None


def write_files(
    target: Storage, staged: Staged, rank: int, report: SaveReport, monitor: StorageMonitor | None = None
) -> list[str]:
    """Every staged write into ``target``; the paths written (tensor bytes are added to the report). ``monitor``
    watches the storage calls (not the waits for device copies)."""
    written: list[str] = []
    host = staged.host(monitor)
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
        return sharding_marks.record_for_save(options.model, model_sd, options.optimizer, topo.tp_size, topo.pp_rank)
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
