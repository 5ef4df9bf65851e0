"""CheckpointManager: the per-process checkpoint state, and the composition of the save and load pipelines.

It owns what lives between calls: the coordinator of the current process group (and the store namespace and
save counter of its commits), the background writer thread, the staging buffers reused by async saves, the
memory tier's run-time, and the writer jobs of earlier saves. Each ``save`` builds a ``SaveOptions`` (or takes one),
waits for the previous save, runs ``save.pipeline.SavePipeline`` over plain values (``SaveServices``) and records
the ``SaveOutcome`` it returns; each ``load`` runs ``load.pipeline.LoadPipeline``. The steps themselves live in
those modules.

Async saves (``async_save=True``): the caller pays for staging only; the write and the store-based commit run
as one job on the ``writer.AsyncWriter`` thread, retention as a second job after it. A new save first waits for
the previous one (logged), and an error in the background is raised, once and chained, by the next
``save``/``load``/``finalize``. See docs/async.md and docs/architecture.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from nxd_ckpt import adapters, knobs, optimizers
from nxd_ckpt.device.backend import resolve_snapshot_budget
from nxd_ckpt.device.kept_budget import KeptSnapshotBudget, device_tensors
from nxd_ckpt.format import layout, retention, tags
from nxd_ckpt.format.metadata import FORMAT_VERSION
from nxd_ckpt.load.pipeline import AsyncResume, LoadPipeline, LoadServices
from nxd_ckpt.load.report import RestoreReport
from nxd_ckpt.log import format_bytes
from nxd_ckpt.options import LoadOptions, SaveOptions, load_options, resolve_budget, save_options
from nxd_ckpt.parallel_state import current_topology
from nxd_ckpt.ranks.coordinator import Coordinator, group_identity
from nxd_ckpt.ranks.deadlines import Deadline
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import capture, plan, staging
from nxd_ckpt.save.context import SaveOutcome, SaveServices, SaveTimer
from nxd_ckpt.save.pipeline import SavePipeline
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.save.writer import AsyncWriter
from nxd_ckpt.storage import Storage, storage_for
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.runtime import TierRuntime, close_quietly

logger = logging.getLogger("nxd_ckpt")

__all__ = [
    "FORMAT_VERSION",
    "CheckpointManager",
    "LoadOptions",
    "RestoreReport",
    "SaveOptions",
    "SaveReport",
]


class CheckpointManager:
    """Per-process owner of everything a save or load needs between calls. One per process is typical."""

    def __init__(
        self,
        *,
        coordinator: Coordinator | None = None,
        topology: Topology | Callable[[], Topology] | None = None,
        storage: Callable[[Any], Storage] | None = None,
        memory_tier: MemoryTier | None = None,
        host_memory_budget: int | str | None = None,
        device_snapshot_budget: int | str | None = None,
    ) -> None:
        """Defaults: a Coordinator over torch.distributed (re-made when the process group changes), the parallel
        state's topology at each call, and ``storage_for`` of the checkpoint directory. Inject others to run the
        manager's policies without processes (``nxd_ckpt.testing.threadworld``) or on another backend.
        ``memory_tier`` is used by every save and load that does not pass its own (docs/memory-tier.md), and
        ``host_memory_budget`` by every async save that does not pass its own (``save.budget``), and
        ``device_snapshot_budget`` by every async save that does not pass its own and by the preparation of the
        first one (``prepare_async_save``, a resume's)."""
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")
        self._injected_coordinator = coordinator
        self._topology_source = topology
        self._storage_for = storage or storage_for
        self._coordinator: Coordinator | None = None
        self._coordinator_key: tuple | None = None
        self._session = ""
        self._seq = 0
        self._async_writer: AsyncWriter | None = None
        self._staging_pool = staging.StagingPool(max_sets=2)
        self._save_jobs: list[Future[str | None]] = []
        """Async saves' writer jobs since the last save: failures they report under ``on_save_error="warn"`` go
        into the next SaveReport."""
        self._retention_jobs: list[Future] = []
        self.memory_tier = memory_tier
        self.host_memory_budget = host_memory_budget
        resolve_budget(host_memory_budget)  # a bad value fails here, not at the first save
        self.device_snapshot_budget = device_snapshot_budget
        resolve_snapshot_budget(device_snapshot_budget)
        self._device_budget = KeptSnapshotBudget()
        """The device snapshot budget the saves agreed on, kept from save to save (``device.kept_budget``)."""
        self._tier_runtime: TierRuntime | None = None
        self._tier_key: tuple | None = None
        self.last_restore: RestoreReport | None = None
        """Set by each load through the memory tier: where every rank's state came from."""

    # ----------------------------------------------------------------- per-process state
    def coordinator(self) -> Coordinator:
        """The coordinator for the current process group (re-created if the group changed), or the injected one."""
        key = self._injected_coordinator if self._injected_coordinator is not None else group_identity()
        if self._coordinator is None or key != self._coordinator_key:
            self._coordinator = self._injected_coordinator or Coordinator()
            self._coordinator_key = key
            # The store namespace of this manager's commits: shared by every rank without a collective.
            self._session = self._coordinator.session if self._coordinator.distributed else uuid.uuid4().hex[:12]
            self._seq = 0
        return self._coordinator

    def topology(self) -> Topology:
        """The layout of this job: the injected topology, else the parallel state's (read at each call)."""
        source = self._topology_source
        if source is None:
            return current_topology()
        return source() if callable(source) else source

    def _tier(self, tier: MemoryTier, url: str, topo: Topology) -> TierRuntime:
        """The memory tier's run-time state for this checkpoint directory and process group (set up once,
        collectively, on the training thread)."""
        key = (tier, url, self._coordinator_key, topo.local_world_size)
        if self._tier_runtime is None or self._tier_key != key:
            close_quietly(self._tier_runtime)
            self._tier_runtime = None
            self._tier_runtime = TierRuntime(tier, url, self.coordinator(), topo.local_world_size, topo.local_rank)
            self._tier_key = key
        return self._tier_runtime

    def _writer(self) -> AsyncWriter:
        """The background writer (made on first use; its thread starts with its first job)."""
        if self._async_writer is None:
            self._async_writer = AsyncWriter()
        return self._async_writer

    def _queued_retention(self, future: Future) -> None:
        self._retention_jobs = [f for f in self._retention_jobs if not f.done()] + [future]

    def _set_restore(self, report: RestoreReport) -> None:
        self.last_restore = report

    # ----------------------------------------------------------------- background work
    def check_for_errors(self) -> None:
        """Raise (once) the error of a background save that failed since the last call (AsyncSaveError)."""
        if self._async_writer is not None:
            self._async_writer.check_for_errors()

    def wait_pending(self) -> float:
        """Wait for every background job (writes, commit, retention); return the seconds waited."""
        return self._async_writer.wait_until_finished() if self._async_writer is not None else 0.0

    def _settle_background(self) -> float:
        """Before a save or load: raise a background failure, wait for pending jobs, raise theirs."""
        self.check_for_errors()
        waited = self.wait_pending()
        self.check_for_errors()
        return waited

    def _settle_saves(self, deadline: Deadline) -> float:
        """Before a save: raise a background failure, wait for the earlier saves' jobs (not for deletions queued
        behind them: the writer runs them before the next save's files), raise theirs; the seconds waited. Past
        ``deadline`` (the new save's) it raises ``CheckpointTimeoutError``: the earlier save goes on, or fails, in
        the background, and nothing of this one was touched."""
        self.check_for_errors()
        start = time.perf_counter()
        _, running = concurrent.futures.wait(self._save_jobs, timeout=deadline.timeout_s)
        waited = time.perf_counter() - start
        if running:
            raise deadline.expired(
                "waiting for the previous async save", f"{len(running)} earlier save(s) still being written"
            )
        self.check_for_errors()
        return waited

    def queue_deletion(self, fn: Callable[[], Any], name: str) -> Future:
        """Run the deletion ``fn`` on the writer thread behind every save submitted so far (so it never touches
        a tag while it is written), like retention: tag listings wait for it (``wait_retention``). For
        frameworks that delete tags themselves (Lightning's ``remove_checkpoint``)."""
        future = self._writer().submit(fn, name=name)
        self._queued_retention(future)
        return future

    def storage(self, checkpoint_dir: Any) -> Storage:
        """The storage this manager reads and writes ``checkpoint_dir`` through (the injected one, if any)."""
        return self._storage_for(checkpoint_dir)

    def remove_tags(
        self,
        checkpoint_dir: Any,
        names: list[str] | None,
        num_kept: int | None = None,
        *,
        wait: bool = False,
        strict: bool = True,
    ) -> Future | None:
        """Rank 0: delete the tags ``names`` (``done`` first), or, without names, what ``KeepLatest(num_kept)``
        no longer keeps, through this manager's storage (``retention.delete_tags``), behind every save already
        queued (``queue_deletion``); ``wait`` blocks until done and raises its error. ``strict`` False logs a
        failed deletion (and an invalid name) instead of raising it (Lightning's ``remove_checkpoint``). Other
        ranks do nothing (NxD's ``g_iostate.submit_remove``, which NxDT and optimum-neuron call, through
        ``nxd_ckpt.compat``)."""
        if strict:
            for name in names or ():
                layout.validate_tag(name)
        if self.coordinator().rank != 0:
            return None
        storage = self._storage_for(checkpoint_dir)

        def job() -> list[str]:
            if names is None:
                doomed = retention.KeepLatest(num_kept).to_delete(tags.list_tags(storage, include_incomplete=True))
            else:
                doomed = names
            deleted = retention.delete_tags(storage, doomed, strict=strict)
            if deleted:
                logger.info("removed checkpoint(s) %s from %s", ", ".join(deleted), storage.url)
            return deleted

        future = self.queue_deletion(job, name=f"remove {', '.join(names) if names else 'by retention'}")
        if wait:
            self.wait_pending()
            self.check_for_errors()
        return future

    def wait_retention(self) -> None:
        """Wait for queued retention deletions (so tag listings see what retention keeps); errors stay with
        the writer (raised by the next save/load/finalize)."""
        for future in list(self._retention_jobs):
            with contextlib.suppress(Exception):
                future.result()
        self._retention_jobs = []

    def finalize(self) -> None:
        """Wait for everything pending, stop the writer, free the staging buffers; raise a background error."""
        writer, self._async_writer = self._async_writer, None
        if writer is not None:
            writer.close()
        self._staging_pool.clear()
        close_quietly(self._tier_runtime)
        self._tier_runtime, self._tier_key = None, None
        if writer is not None:
            writer.check_for_errors()

    # ----------------------------------------------------------------- save and load
    def prepare_async_save(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        use_xser: bool = False,
        device_snapshot_budget: int | str | None = None,
    ) -> int:
        """Reserve and fault in, on a low-priority background thread, the host buffers the first async save of
        ``model``/``optimizer`` will copy into, and take its device snapshot of XLA state once (its graph is then
        compiled), so that it blocks no longer than later ones. ``use_xser`` as the saves will pass it: with DP
        replicas a rank snapshots only its share of the files, which depends on it. Call it once the model and
        optimizer exist (after a resume load, say); returns the host bytes reserved (0 when buffers are already
        held). A later save with a host memory budget does not use them; ``finalize`` frees them. The snapshot is
        taken within the saves' budget: ``device_snapshot_budget`` as they will pass it (default: the manager's,
        else ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET``), the one earlier saves agreed on once they have."""
        return self._prepare(model, optimizer, use_xser=use_xser, host_buffers=True, budget=device_snapshot_budget)

    def _prepare_after_resume(self, resumed: AsyncResume, model: Any, optimizer: Any) -> None:
        """After a load that resumed an async-saved tag into ``model`` and ``optimizer`` (its step 6):
        ``prepare_async_save`` of them, so the first async save after the resume blocks like the later ones,
        without host buffers when a host memory budget is set (those saves stage in pieces and would not use
        them, and a whole copy of the state held from the load on would break the budget). A failure leaves the
        loaded state as it is: it is logged, and the first save pays as without the step
        (``NXD_CKPT_PREPARE_ON_RESUME=0``: no step)."""
        if not knobs.prepare_on_resume():
            return
        budgeted = resolve_budget(self.host_memory_budget) is not None
        start = time.perf_counter()
        try:
            reserved = self._prepare(model, optimizer, use_xser=resumed.use_xser, host_buffers=not budgeted)
        except Exception as e:  # the load itself succeeded; the next save prepares itself
            logger.warning(
                "the load of %r succeeded, but preparing the next async save failed (%s: %s); the first async save "
                "will pay its one-time costs itself (NXD_CKPT_PREPARE_ON_RESUME=0 skips this step)",
                resumed.tag, type(e).__name__, e,
            )  # fmt: skip
            return
        logger.debug("prepared the next async save after the resume: %s of host buffers in %.3f s",
                     format_bytes(reserved), time.perf_counter() - start)  # fmt: skip

    def _prepare(
        self, model: Any, optimizer: Any, *, use_xser: bool, host_buffers: bool, budget: int | str | None = None
    ) -> int:
        model_state = adapters.model_state(model) if model is not None else None
        optimizer_state = adapters.optimizer_state(optimizer) if optimizer is not None else None
        trees = [t for t in (model_state, optimizer_state) if t is not None]
        zero1 = optimizer is not None and optimizers.is_zero1_optimizer(optimizer)
        planned = plan.planned_tensors(self.topology(), model_state, optimizer, use_xser=use_xser, zero1=zero1)
        asked = resolve_snapshot_budget(budget if budget is not None else self.device_snapshot_budget)
        state = device_tensors(trees)
        device_budget = self._device_budget.for_warm_up(asked, state) if state else None
        return self._staging_pool.prepare(
            trees if host_buffers else [], snapshot_of=planned, device_budget=device_budget
        )

    def save(
        self, checkpoint_dir: str | os.PathLike[str] | SaveOptions, tag: str | None = None, **keywords: Any
    ) -> SaveReport:
        """Save a checkpoint (``api.save_checkpoint`` documents the options); every rank must call it. Takes a
        ``SaveOptions``, or builds one from the same arguments as ``save_checkpoint``."""
        timer = SaveTimer()
        options = save_options(checkpoint_dir, tag, **keywords)
        if options.memory_tier is None and self.memory_tier is not None:
            options = options.replace(memory_tier=self.memory_tier)
        if options.host_memory_budget is None and self.host_memory_budget is not None:
            options = options.replace(host_memory_budget=self.host_memory_budget)
        if options.device_snapshot_budget is None and self.device_snapshot_budget is not None:
            options = options.replace(device_snapshot_budget=self.device_snapshot_budget)
        ran_pending_step = adapters.run_pending_step(options.model, options.optimizer)
        model_state = capture.model_state(options)  # built once per save; meta tensors refused on every rank
        waited = self._settle_saves(Deadline(options.timeout_s, self.coordinator().rank))
        earlier_failures = self._background_failures()
        coord = self.coordinator()
        report = SaveReport(
            tag=options.tag,
            checkpoint_dir=str(getattr(options.checkpoint_dir, "url", options.checkpoint_dir)),
            async_save=options.async_save,
            waited_s=waited,
            earlier_failures=earlier_failures,
            ran_pending_step=ran_pending_step,
        )
        with coord.deadline(options.timeout_s):
            outcome = SavePipeline(self._save_services(coord, timer, model_state)).run(options, report)
        self._record(outcome)
        error = outcome.error
        del outcome
        if error is not None:
            try:
                raise error
            finally:
                del error  # this frame, in the traceback, must not keep the error alive (as Future.result does)
        return report

    def _record(self, outcome: SaveOutcome) -> None:
        """What a save handed back: the sequence number it used, its writer jobs (retention is waited for by tag
        listings, a save job's warned failure is reported by the next save)."""
        if outcome.seq is not None:
            self._seq = outcome.seq
        if outcome.job is not None:
            self._save_jobs.append(outcome.job)
        if outcome.retention is not None:
            self._queued_retention(outcome.retention)

    def _background_failures(self) -> list[str]:
        """The failures ended async saves returned under ``on_save_error="warn"``, in order, each reported once."""
        jobs, self._save_jobs = self._save_jobs, []
        failures: list[str] = []
        for job in jobs:
            if not job.done():
                self._save_jobs.append(job)
            elif not job.cancelled() and job.exception() is None and (failure := job.result()) is not None:
                failures.append(failure)
        return failures

    def load(
        self, checkpoint_dir: str | os.PathLike[str] | LoadOptions, tag: str | None = None, **keywords: Any
    ) -> Any:
        """Load a checkpoint (``api.load_checkpoint`` documents the options); every rank must call it. Takes a
        ``LoadOptions``, or builds one from the same arguments as ``load_checkpoint``. Returns the user content."""
        options = load_options(checkpoint_dir, tag, **keywords)
        if options.memory_tier is None and self.memory_tier is not None:
            options = options.replace(memory_tier=self.memory_tier)
        self._settle_background()
        pipeline = LoadPipeline(self._load_services(self.coordinator()))
        result = pipeline.run(options)
        if pipeline.resumed is not None:
            self._prepare_after_resume(pipeline.resumed, options.model, options.optimizer)
        return result

    def _save_services(self, coord: Coordinator, timer: SaveTimer, model_state: Any = None) -> SaveServices:
        return SaveServices(
            coordinator=coord,
            session=self._session,
            seq=self._seq + 1,
            writer=self._writer(),
            staging_pool=self._staging_pool,
            timer=timer,
            topology=self.topology,
            storage_for=self._storage_for,
            tier_runtime=self._tier,
            pending_deletions=tuple(f for f in self._retention_jobs if not f.done()),
            device_budget=self._device_budget,
            model_state=model_state,
        )

    def _load_services(self, coord: Coordinator) -> LoadServices:
        return LoadServices(
            coordinator=coord,
            topology=self.topology,
            storage_for=self._storage_for,
            tier_runtime=self._tier,
            on_restore=self._set_restore,
        )
