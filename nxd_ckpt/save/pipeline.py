"""The steps of one save, in the order the data takes them: begin → plan → stage → write → commit → retention.

``SavePipeline.run`` composes them and does nothing else: each step is a module of ``save/`` (or ``tier/``,
``format/``) testable alone (``testing.threadworld`` runs the whole pipeline in one process with one thread per
rank).

  begin      every rank's layout is checked; the per-rank state (data loaders, RNG) and the model's state dict
             are captured as they are at the call (``capture``; the per-rank state gathered to rank 0 in "gather"
             mode); rank 0 begins the tag's commit (``commit.prepare_tag``: a complete tag is re-saved beside
             it) and merges the sharding record (``sharding_marks.merge_shares``), and every rank learns the
             save's identity (``SaveContext``);
  plan       every file this rank writes, one value (``plan.SavePlan``): its state files (``plan.plan_save``),
             then its per-rank state files;
  stage      every copy, by one strategy of ``stage``: pooled (async: a training-safe host copy in
             ``staging.StagingPool``, then the write is handed to the writer thread), budgeted (async under a
             host memory budget: the write is handed over first and the call copies what fits the budget while
             it writes, waiting for the rest: ``budget.BudgetedStager``), or live (sync: a thread fetching device
             tensors ahead of the writers); the only step an async save blocks on besides ``begin`` and ``plan``;
  write      this rank's files, durable, with its manifest (``write``; or through the memory tier in one call
             of it: node memory, its peers, and every ``durable_every``-th time the checkpoint directory),
             watched for stalls;
  commit     ``commit.commit``: ranks arrive on the c10d store, rank 0 writes metadata and ``done`` last;
  retention  rank 0, a writer job after the commit: what ``num_kept_ckpts`` no longer keeps is deleted.

Steps write and commit use no collectives, so an async save runs them as one job on the writer thread. A
rank that fails before writing still arrives (with its error), so rank 0's commit never waits for it in vain.
The manager hands a save its per-process objects and this call's number and clock (``SaveServices``); the
save hands back what the manager keeps (``SaveOutcome``: the sequence number it used, its writer jobs, the
error to raise). The pipeline alone fills in the ``SaveReport``, reading every duration off one ``SaveTimer``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from nxd_ckpt.device import kept_budget
from nxd_ckpt.format import retention, sharding_marks
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.save import capture, commit, plan, replicated, stage, write
from nxd_ckpt.save.context import Captured, Destination, SaveContext, SaveOutcome, SaveServices, Staged
from nxd_ckpt.save.report import SaveReport

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
                ctx = self.enter_tier(ctx, planned)
            staged = self.stage(ctx, planned, report, stage_start)
            if not options.async_save:
                self.write_and_commit(ctx, staged, report, waves=options.num_workers)
            # Deletions go to the writer thread, after 'done' (the commit): the training thread never waits for them.
            retention_job = self.queue_retention(ctx, report)
            report.blocked_s = self.timer.since()
            if not options.async_save:
                log_save(report, self.coord.rank)
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
        coord, services = self.coord, self.services
        if report.waited_s >= 0.001 and coord.rank == 0:
            logger.info("save of %s waited %.2f s for the previous save to finish writing", options.tag,
                        report.waited_s)  # fmt: skip
        topo = coord.run_all(services.topology, f"starting checkpoint {options.tag!r}")  # checked everywhere
        storage = services.storage_for(options.checkpoint_dir)
        model_sd = services.model_state if services.model_state is not None else capture.model_state(options)
        captured = capture.capture(coord, topo, options, model_sd, services.device_budget)
        runtime = services.tier_runtime(options.memory_tier, storage.url, topo) if options.memory_tier else None
        durable = runtime.count_save() if runtime is not None else True
        ctx = self.mark_tag(options, Destination(storage, topo, runtime, durable), captured)
        report.checkpoint_dir = storage.url
        return ctx, captured

    def mark_tag(self, options: SaveOptions, where: Destination, captured: Captured) -> SaveContext:
        """Rank 0 receives every rank's share of the sharding record, checks that a replicated optimizer is the same
        on every replica (``replicated.check_replicas``: refused before anything is written), then begins the tag's
        commit (``commit.prepare_tag``: a complete tag is re-saved beside it); all ranks agree on the save and on
        the device snapshot budget (the least of the ranks' proposals, kept for the next saves): one world-wide
        step. A save to the memory tier only (``where.durable`` False) leaves the checkpoint directory alone."""
        coord, tag, services = self.coord, options.tag, self.services
        proposal = captured.budget_proposal

        def agree(shares: list[tuple[Any, int | None, replicated.OptimizerFingerprint | None]]) -> int | None:
            replicated.check_replicas([f for _, _, f in shares], where.topology.replica_groups())
            return kept_budget.agree([p for _, p, _ in shares])

        gathered, ((created_at, resaved), agreed) = coord.gather_to_master_and_master_computes(
            (captured.sharding_share, proposal, captured.optimizer_fingerprint),
            lambda: (
                commit.prepare_tag(where.storage, tag, where.durable, services.pending_deletions, options.timeout_s)
                if coord.rank == 0
                else (0.0, False)
            ),
            f"starting checkpoint {tag!r}",
            agree=agree,
        )
        if proposal is not None and agreed is not None:  # the snapshot of every rank is cut alike
            options = options.replace(device_snapshot_budget=services.device_budget.agree(agreed).bytes)
        record = None
        if gathered is not None and options.model is not None:
            record = sharding_marks.merge_shares(share for share, _, _ in gathered)
        target = commit.open_target(
            where.storage, tag, rank=coord.rank, world_size=coord.world_size, created_at=created_at,
            resaved=resaved, durable=where.durable, timeout_s=options.timeout_s, topology=where.topology,
            zero1=captured.zero1, use_xser=options.use_xser, items=options.items, saved_async=options.async_save,
            sharding=record,
        )  # fmt: skip
        return SaveContext(options, target, services.seq, coord, services.session, where.runtime)

    # ------------------------------------------------------------------ plan
    def plan(self, ctx: SaveContext, captured: Captured) -> plan.SavePlan:
        """Every file this rank writes: its state files, then the per-rank state files ``begin`` captured."""
        options = ctx.options
        state_files = plan.plan_save(
            ctx.commit.topology, ctx.tag, model=captured.model, optimizer=plan.optimizer_tree(options.optimizer),
            scheduler=capture.scheduler_state(options), user_content=options.user_content,
            zero1=ctx.commit.zero1, use_xser=options.use_xser,
        )  # fmt: skip
        return plan.SavePlan(tuple(state_files), plan.rank_state_writes(captured.rank_files, self.coord.rank))

    def enter_tier(self, ctx: SaveContext, planned: plan.SavePlan) -> SaveContext:
        """Before staging: a node that cannot hold the save fails it here, on every rank."""
        coord, runtime = self.coord, ctx.runtime
        assert runtime is not None
        rank_bytes = sum(t.numel() * t.element_size() for t in plan.tensors_to_write(planned.state_files, coord.rank))
        with ctx.arrive_on_failure():
            coord.run_all(lambda: runtime.check_budget(ctx.tag, rank_bytes), "memory tier: checking the budget")
        tier = runtime.begin_save(ctx.tag, ctx.commit.created_at, coord.world_size, ctx.monitor)
        return replace(ctx, tier=tier)

    # ------------------------------------------------------------------ stage
    def stage(self, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport, stage_start: float) -> Staged:
        """Every copy of the save, by the strategy its options choose (``stage``: budgeted, pooled or live). An
        async save's write is handed to the writer thread here (``hand_off``); ``staging_s`` runs from
        ``stage_start`` (before ``plan``)."""
        options = ctx.options
        if options.async_save:
            self.services.writer.start()  # before any copy keeps the device (or the host) busy
        if options.async_save and options.budget_bytes is not None:
            staged, frozen = stage.budgeted(self.services, ctx, planned, report)
            report.staging_s = self.timer.since(stage_start)
            self.hand_off(ctx, staged, report)
            stage.run_budgeted(staged, frozen, report)  # copies what fits beside the writer, waits for the rest
            report.staging_s = self.timer.since(stage_start)
            return staged
        with ctx.arrive_on_failure():
            staged = (
                stage.pooled(self.services, ctx, planned, report) if options.async_save else stage.live(ctx, planned)
            )
        report.staging_s = self.timer.since(stage_start)
        if options.async_save:
            self.hand_off(ctx, staged, report)
        return staged

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
        log_save(report, self.coord.rank)
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
                write_files = lambda: self.write(ctx, staged, report)  # noqa: E731
                # no world-wide step after the waves: the commit right after carries the failures
                coord.in_waves(waves, topo.local_rank, topo.local_world_size, write_files, what, check=False)
            else:
                self.write(ctx, staged, report)
        except BaseException as e:
            error = e
        report.write_s = self.timer.since(write_start)
        error = error or stage.close(staged, ctx, report)
        try:
            commit.commit(ctx.barrier(), ctx.commit, coord.rank, error)
        finally:
            report.total_s = self.timer.since()
        report.completed = True

    def write(self, ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
        """This rank's files (``write.write_rank``: durable, or through the memory tier), watched for stalls."""
        write.write_rank(ctx, staged, report)

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


def log_save(report: SaveReport, rank: int) -> None:
    """One INFO line per save, on the master rank (async saves: when the commit outcome is known)."""
    if rank == 0:
        logger.info("%s", report.summary())
