"""CheckpointManager: owns the per-process checkpoint state (coordinator, background writer, save counter).

``save`` call order, on every rank:
  1. begin      rank 0 prepares the tag (``checkpoint`` marker) and broadcasts the save's identity;
  2. plan       which state files this rank writes (``plan.plan_save``);
  3. stage      the state is copied to host memory (``staging``), the only part async saves block on;
  4. write      the files are written and made durable (inline, or on the writer thread);
  5. commit     ranks ``arrive`` on the store; rank 0 writes metadata and ``done`` last, then retention.
Steps 4-5 use no collectives, so they can run on a background thread.

Async saves (``async_save=True``): the caller pays for steps 1-3 only. Staging copies into host buffers reused
from the previous save (``staging.StagingPool``); steps 4-5 run as one job on the ``writer.AsyncWriter``
thread and hand the buffers back as soon as the files are durable; retention is a second job after the commit.
The commit happens as soon as the last rank's files are durable, with no further call from the training loop:
every rank ``arrive``s on the c10d store and rank 0's writer thread polls it and writes ``done``. The store,
not a collective, because a collective from the writer thread would interleave with the training thread's
collectives on the same group (gloo and the XLA runtime require every rank to issue them in the same order)
and would need all ranks to enter it, while the store is a thread-safe key-value client that rank 0 can poll
without the others doing anything. A new save first waits for the previous one (logged), and an error in the
background is raised, once and chained, by the next ``save``/``load``/``finalize``. See docs/async.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt import adapters, statefile, tree, xla
from nxd_ckpt import rank_state as rank_states
from nxd_ckpt.dist import replicas as replica_reads
from nxd_ckpt.dist.coordinator import (
    Coordinator,
    RankFailure,
    format_exception,
    group_identity,
    mark_origin,
    resolve_timeout,
)
from nxd_ckpt.dist.topology import Topology
from nxd_ckpt.errors import (
    CheckpointTimeoutError,
    FormatError,
    IntegrityError,
    LayoutMismatchError,
    RemoteRankError,
)
from nxd_ckpt.format import integrity, layout, sharding, tags
from nxd_ckpt.format.describe import TagDescription, describe
from nxd_ckpt.format.metadata import FORMAT_VERSION, TagMetadata, metadata_path, write_metadata
from nxd_ckpt.format.sharding import ShardingRecord
from nxd_ckpt.load import reshard, zero1_io
from nxd_ckpt.log import format_bytes, format_rate
from nxd_ckpt.parallel_state import current_topology
from nxd_ckpt.save import plan, staging
from nxd_ckpt.save.commit import CommitBarrier
from nxd_ckpt.save.writer import AsyncWriter
from nxd_ckpt.storage import Storage, storage_for
from nxd_ckpt.tier.memory import MemoryTier, choose_memory_tag
from nxd_ckpt.tier.runtime import TierRuntime, TierSave, close_quietly
from nxd_ckpt.tier.view import TierView
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage, run_watched

logger = logging.getLogger("nxd_ckpt")

__all__ = ["FORMAT_VERSION", "CheckpointManager", "RestoreReport", "SaveReport", "describe_checkpoint"]
SAVE_ERROR_POLICIES = ("raise", "warn")


@dataclass
class SaveReport:
    """What one save cost; for async saves the write fields are filled in when the background write ends."""

    tag: str
    checkpoint_dir: str
    async_save: bool
    bytes_written: int = 0
    """Tensor bytes this rank wrote."""
    blocked_s: float = 0.0
    """Time the caller was blocked in ``save``, including ``waited_s``."""
    waited_s: float = 0.0
    """Part of ``blocked_s`` spent waiting for the previous save to finish writing."""
    staging_s: float = 0.0
    """Time to plan and copy the state to host memory."""
    staging_allocated_bytes: int = 0
    """Host staging memory newly allocated by this save (0 when the previous save's buffers were reused)."""
    write_s: float = 0.0
    """Time to write this rank's files and make them durable."""
    total_s: float = 0.0
    """From the call to the commit outcome (``done`` written, or known on other ranks)."""
    files_written: int = 0
    completed: bool = False
    error: str | None = None
    """Why this save failed, with ``on_save_error="warn"`` (for async saves: once the background write ended)."""
    earlier_failures: list[str] = field(default_factory=list)
    """Background saves that failed since the previous save under ``on_save_error="warn"``."""
    _future: Future | None = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_written / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def summary(self) -> str:
        """One log line: what the save cost."""
        mode = "async" if self.async_save else "sync"
        waited = f" (of which {self.waited_s:.2f} s waiting for the previous save)" if self.waited_s >= 0.001 else ""
        return (
            f"saved {self.tag} ({mode}): {format_bytes(self.bytes_written)} on this rank, training blocked "
            f"{self.blocked_s:.3f} s{waited}, staging {self.staging_s:.3f} s, write {self.write_s:.2f} s "
            f"({format_rate(self.bytes_written, self.write_s)}), durable after {self.total_s:.2f} s"
        )

    def wait(self) -> SaveReport:
        """Block until this save is durable on this rank (re-raises its error)."""
        if self._future is not None:
            self._future.result()
        return self


@dataclass(frozen=True)
class RestoreReport:
    """Where a load through the memory tier found its checkpoint: the tag, and each rank's tier."""

    tag: str
    tiers: list[str]
    """By rank: ``memory`` (this node's memory directory), ``peer`` (files fetched from another node), or
    ``durable`` (the checkpoint directory)."""

    @property
    def tier(self) -> str:
        """The tier of this load as a whole: the furthest any rank had to go."""
        order = ("memory", "peer", "durable")
        return max(self.tiers, key=order.index) if self.tiers else "durable"

    def summary(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, tier in enumerate(self.tiers):
            groups.setdefault(tier, []).append(rank)
        return ", ".join(f"{tier}: ranks {_ranges(ranks)}" for tier, ranks in groups.items())


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


@dataclass(frozen=True)
class _SaveContext:
    storage: Storage
    tag: str
    seq: int
    created_at: float
    topology: Topology
    zero1: bool
    use_xser: bool
    num_kept_ckpts: int | None
    items: tuple[str, ...]
    timeout_s: float
    monitor: StorageMonitor
    sharding: ShardingRecord | None = None
    """How the model's tensors are sharded (rank 0 only; recorded in nxd_ckpt.json)."""
    resave_of: Storage | None = None
    """Set when the tag already held a complete checkpoint: this save is written beside it (tags.ResaveStorage)
    and swapped in by rank 0's commit; the storage the swap happens in."""
    durable: bool = True
    """Whether this save goes to the checkpoint directory (with a memory tier: every ``durable_every``-th)."""
    tier: TierSave | None = None
    """This rank's part of the save in the memory tier, if one is used."""


class CheckpointManager:
    """Per-process owner of everything a save or load needs between calls. One per process is typical."""

    def __init__(
        self,
        *,
        coordinator: Coordinator | None = None,
        topology: Topology | Callable[[], Topology] | None = None,
        storage: Callable[[Any], Storage] | None = None,
        memory_tier: MemoryTier | None = None,
    ) -> None:
        """Defaults: a Coordinator over torch.distributed (re-made when the process group changes), the parallel
        state's topology at each call, and ``storage_for`` of the checkpoint directory. Inject others to run the
        manager's policies without processes (``nxd_ckpt.testing.threadworld``) or on another backend.
        ``memory_tier`` is used by every save and load that does not pass its own (docs/memory-tier.md)."""
        self._injected_coordinator = coordinator
        self._topology_source = topology
        self._storage_for = storage or storage_for
        self._coordinator: Coordinator | None = None
        self._coordinator_key: tuple | None = None
        self._session: str | None = None
        self._seq = 0
        self._async_writer: AsyncWriter | None = None
        self._staging_pool = staging.StagingPool(max_sets=2)
        self._warned: list[str] = []
        """Background save failures under ``on_save_error="warn"``, reported by the next SaveReport."""
        self._retention_jobs: list[Future] = []
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")
        self.memory_tier = memory_tier
        self._tier_runtime: TierRuntime | None = None
        self._tier_key: tuple | None = None
        self._tier_saves = 0
        self.last_restore: RestoreReport | None = None
        """Set by each load through the memory tier: where every rank's state came from."""

    # ----------------------------------------------------------------- plumbing
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

    def _tier(self, tier: MemoryTier, url: str, coord: Coordinator, topo: Topology) -> TierRuntime:
        """The memory tier's run-time state for this checkpoint directory and process group (set up once,
        collectively, on the training thread)."""
        key = (tier, url, self._coordinator_key, topo.local_world_size)
        if self._tier_runtime is None or self._tier_key != key:
            close_quietly(self._tier_runtime)
            self._tier_runtime = None
            self._tier_runtime = TierRuntime(tier, url, coord, topo.local_world_size, topo.local_rank)
            self._tier_key = key
            self._tier_saves = 0
        return self._tier_runtime

    def _resolve_tier(self, memory_tier: MemoryTier | None) -> MemoryTier | None:
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")
        return memory_tier if memory_tier is not None else self.memory_tier

    def _writer(self) -> AsyncWriter:
        if self._async_writer is None:
            self._async_writer = AsyncWriter()
        return self._async_writer

    def check_for_errors(self) -> None:
        """Raise (once) the error of a background save that failed since the last call (AsyncSaveError)."""
        if self._async_writer is not None:
            self._async_writer.check_for_errors()

    def wait_pending(self) -> float:
        """Wait for every background job (writes, commit, retention); return the seconds waited."""
        return self._async_writer.wait_until_finished() if self._async_writer is not None else 0.0

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

    # ----------------------------------------------------------------- save
    def save(
        self,
        checkpoint_dir: str | os.PathLike[str],
        tag: str,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        user_content: Any = None,
        num_workers: int = 8,
        use_xser: bool = False,
        num_kept_ckpts: int | None = None,
        async_save: bool = False,
        zero1_optimizer: bool = False,
        rank_state: Any = None,
        save_rng: bool = False,
        rank_state_mode: str = "per_rank",
        timeout: float | None = None,
        on_save_error: str = "raise",
        *,
        memory_tier: MemoryTier | None = None,
    ) -> SaveReport:
        call_start = time.perf_counter()
        tier = self._resolve_tier(memory_tier)
        layout.validate_tag(tag)
        if on_save_error not in SAVE_ERROR_POLICIES:
            raise ValueError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        timeout_s = resolve_timeout(timeout)
        if num_kept_ckpts is not None and (
            isinstance(num_kept_ckpts, bool)
            or not isinstance(num_kept_ckpts, int)
            or num_kept_ckpts < -1
            or num_kept_ckpts == 0
        ):
            raise ValueError(
                f"num_kept_ckpts must be None or -1 (keep all, as in NxD) or an integer >= 1, got {num_kept_ckpts!r}"
            )
        if num_kept_ckpts == -1:  # NxD's "keep all" (its examples' --num_kept_checkpoint default)
            num_kept_ckpts = None
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        if model is not None:  # before any collective or file: a model without data fails here, on every rank
            adapters.refuse_meta_for_save(adapters.model_state(model), "model")
        self.check_for_errors()
        waited = self.wait_pending()
        self.check_for_errors()
        earlier_failures, self._warned = self._warned, []

        coord = self.coordinator()
        report = SaveReport(
            tag=tag,
            checkpoint_dir=str(getattr(checkpoint_dir, "url", checkpoint_dir)),
            async_save=async_save,
            waited_s=waited,
            earlier_failures=earlier_failures,
        )
        report._started = call_start
        try:
            with coord.deadline(timeout_s):
                self._save(
                    coord, report, checkpoint_dir, tag, model, optimizer, scheduler, user_content, num_workers,
                    use_xser, num_kept_ckpts, async_save, zero1_optimizer, rank_state, save_rng, rank_state_mode,
                    timeout_s, on_save_error, tier,
                )  # fmt: skip
        except Exception as e:
            if on_save_error == "raise":
                raise
            self._warn_failed(report, e)
        report.blocked_s = time.perf_counter() - call_start
        return report

    def _warn_failed(self, report: SaveReport, error: BaseException) -> None:
        """``on_save_error="warn"``: log the failure (on every rank) and record it instead of raising."""
        report.error = format_exception(error)
        logger.error(
            "checkpoint %s in %s FAILED and training continues (on_save_error='warn'); the previous complete "
            "checkpoint stays the latest: %s",
            report.tag,
            report.checkpoint_dir,
            report.error,
        )

    def _save(
        self,
        coord: Coordinator,
        report: SaveReport,
        checkpoint_dir: str | os.PathLike[str],
        tag: str,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        user_content: Any,
        num_workers: int,
        use_xser: bool,
        num_kept_ckpts: int | None,
        async_save: bool,
        zero1_optimizer: bool,
        rank_state: Any,
        save_rng: bool,
        rank_state_mode: str,
        timeout_s: float,
        on_save_error: str,
        tier: MemoryTier | None = None,
    ) -> None:
        call_start, waited = report._started, report.waited_s
        if waited >= 0.001 and coord.rank == 0:
            logger.info("save of %s waited %.2f s for the previous save to finish writing", tag, waited)
        topo = coord.run_all(self.topology, f"starting checkpoint {tag!r}")  # every rank's layout, checked
        storage = self._storage_for(checkpoint_dir)
        zero1 = bool(zero1_optimizer) or adapters.is_zero1_optimizer(optimizer)
        items = tuple(
            name
            for name, obj in (
                ("model", model),
                ("optimizer", optimizer),
                ("scheduler", scheduler),
                ("user_content", user_content),
            )
            if obj is not None
        )
        # Per-rank state (data loaders, RNG) is captured first: in "gather" mode this is a collective.
        rank_files = rank_states.stage_for_save(
            coord, topo, tag, rank_state, save_rng=save_rng, mode=rank_state_mode, copy_state=async_save
        )
        model_sd = adapters.model_state(model) if model is not None else None
        record = _record_sharding(coord, topo, model, model_sd, optimizer) if model is not None else None
        runtime, durable = None, True
        if tier is not None:
            runtime = self._tier(tier, storage.url, coord, topo)
            self._tier_saves += 1
            durable = self._tier_saves % tier.durable_every == 0
        ctx = self._begin(coord, storage, tag, topo, zero1, use_xser, num_kept_ckpts, items, timeout_s, record, durable)
        report.checkpoint_dir = storage.url
        stage_start = time.perf_counter()
        writes = plan.plan_save(
            topo,
            tag,
            model=model_sd,
            optimizer=tree.nxd_containers(adapters.optimizer_state(optimizer)) if optimizer is not None else None,
            scheduler=adapters.scheduler_state(scheduler) if scheduler is not None else None,
            user_content=user_content,
            zero1=zero1,
            use_xser=use_xser,
        )
        if runtime is not None:  # before staging: a node that cannot hold the save fails it here, on every rank
            rank_bytes = sum(t.numel() * t.element_size() for t in plan.tensors_to_write(writes, coord.rank))
            try:
                coord.run_all(lambda: runtime.check_budget(tag, rank_bytes), "memory tier: checking the budget")
            except BaseException as e:
                self._barrier(ctx, coord).arrive(e)
                raise
            ctx = dataclasses.replace(ctx, tier=runtime.begin_save(tag, ctx.created_at, coord.world_size, ctx.monitor))
        lease: staging.StagedState | None = None
        fetcher: staging.HostFetcher | None = None
        if async_save:  # a training-safe copy in reused host buffers, handed back once the files are durable
            try:
                needed = {id(t) for t in plan.tensors_to_write(writes, coord.rank)}
                lease = self._staging_pool.stage([w.state for w in writes], needed=needed)
            except BaseException as e:
                # Tell rank 0's commit that this rank will never write, instead of letting it wait until timeout.
                self._barrier(ctx, coord).arrive(e)
                raise
            staged = [w.with_state(state) for w, state in zip(writes, lease.trees, strict=True)]
            report.staging_allocated_bytes = lease.allocated_bytes
        else:
            # Device tensors are copied to the host by a thread running ahead of the writers (one sync for all).
            staged = list(writes)
            if any(staging.has_device_tensors(w.state) for w in writes):
                try:
                    fetcher = staging.HostFetcher(plan.tensors_to_write(writes, coord.rank))
                except BaseException as e:  # as for async staging: rank 0's commit must not wait for this rank
                    self._barrier(ctx, coord).arrive(e)
                    raise
        staged += [plan.StateWrite("rank_state", path, state, (coord.rank,)) for path, state in rank_files]
        report.staging_s = time.perf_counter() - stage_start

        def write_and_commit() -> None:
            try:
                self._write_and_commit(
                    ctx, coord, staged, report, num_workers if not async_save else None, lease, fetcher
                )
            except Exception as e:
                if not async_save or on_save_error == "raise":
                    raise
                self._warn_failed(report, e)  # on the writer thread: reported by the next save's SaveReport
                self._warned.append(f"{tag}: {report.error}")
                return
            finally:
                if fetcher is not None:
                    fetcher.close()
            if async_save:
                self._log_save(report, coord)

        if async_save:
            writer = self._writer()
            report.blocked_s = time.perf_counter() - call_start  # set first: the job logs it
            report._future = writer.submit(write_and_commit, name=f"save {tag}")
            self._queue_retention(ctx, report, coord)
            report.blocked_s = time.perf_counter() - call_start
        else:
            write_and_commit()
            # Deletions go to the writer thread, after 'done' (the commit): the training thread never waits for
            # them. The next save or load, and listing tags, wait for them first (``wait_retention``).
            self._queue_retention(ctx, report, coord)
            report.blocked_s = time.perf_counter() - call_start
            self._log_save(report, coord)

    def _barrier(self, ctx: _SaveContext, coord: Coordinator) -> CommitBarrier:
        return CommitBarrier(
            coord.store, str(self._session), ctx.seq, coord.rank, coord.world_size, ctx.timeout_s, ctx.tag
        )

    def _queue_retention(self, ctx: _SaveContext, report: SaveReport, coord: Coordinator) -> None:
        """Rank 0: retention as a writer job behind the save (it runs only if the save was committed)."""
        if coord.rank != 0 or ctx.num_kept_ckpts is None or not ctx.durable:
            return
        future = self._writer().submit(lambda: self._retention_after(ctx, report), name=f"retention after {ctx.tag}")
        self._retention_jobs = [f for f in self._retention_jobs if not f.done()] + [future]

    def wait_retention(self) -> None:
        """Wait for queued retention deletions (so tag listings see what retention keeps); errors stay with
        the writer (raised by the next save/load/finalize)."""
        for future in list(self._retention_jobs):
            with contextlib.suppress(Exception):
                future.result()
        self._retention_jobs = []

    # ----------------------------------------------------------------- deletions by name (nxd_ckpt.compat)
    def remove_tags(
        self, checkpoint_dir: Any, names: list[str] | None, num_kept: int | None = None, *, wait: bool = False
    ) -> Future | None:
        """Rank 0: delete the tags ``names`` (``done`` first), or, without names, what keeping the newest
        ``num_kept`` complete tags selects (``tags.remove_selection``), as a writer job behind every save
        already queued, so no save in flight loses a file; ``wait`` blocks until done and raises its error.
        Other ranks do nothing (NxD's ``g_iostate.submit_remove``, which NxDT and optimum-neuron call)."""
        for name in names or ():
            layout.validate_tag(name)
        if self.coordinator().rank != 0:
            return None
        storage = self._storage_for(checkpoint_dir)

        def job() -> list[str]:
            doomed = names if names is not None else tags.remove_selection(storage, num_kept)
            for name in doomed:
                if storage.exists(name):
                    tags.delete_tag(storage, name)
            if doomed:
                logger.info("removed checkpoint(s) %s from %s", ", ".join(doomed), storage.url)
            return doomed

        future = self._writer().submit(job, name=f"remove {', '.join(names) if names else 'by retention'}")
        if wait:
            self.wait_pending()
            self.check_for_errors()
        return future

    def _begin(
        self,
        coord: Coordinator,
        storage: Storage,
        tag: str,
        topo: Topology,
        zero1: bool,
        use_xser: bool,
        num_kept_ckpts: int | None,
        items: tuple[str, ...],
        timeout_s: float,
        sharding: ShardingRecord | None = None,
        durable: bool = True,
    ) -> _SaveContext:
        """Rank 0 marks the tag as being saved (a complete one is re-saved beside it); all ranks agree on the save.
        A save to the memory tier only (``durable`` False) leaves the checkpoint directory alone."""

        def prepare() -> tuple[float, bool]:
            if coord.rank != 0:
                return 0.0, False
            if not durable:
                return time.time(), False
            tags.recover_resaves(storage)  # a re-save a crash interrupted is finished or dropped first
            if tags.holds_complete_checkpoint(storage, tag):
                # The tag holds a complete checkpoint: write the new one beside it and swap it in once it is
                # complete (tags.swap_in_resave), so the old one stays loadable until then.
                tags.begin_resave(storage, tag)
                return time.time(), True
            # A new tag, the leftovers of an interrupted save of it, or a bare 'done': rewritten in place.
            storage.delete(layout.tag_path(tag, layout.DONE_MARKER))
            storage.delete(metadata_path(tag))
            integrity.remove_manifests(storage, tag)  # stale ones (e.g. another world size) would fail verify
            storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
            return time.time(), False

        created_at, resave = coord.master_computes(prepare, f"starting checkpoint {tag!r}")
        self._seq += 1
        target = tags.ResaveStorage(storage, tag) if resave else storage
        monitor = StorageMonitor(f"writing {tag!r} on rank {coord.rank}", timeout_s, url=storage.url)
        return _SaveContext(
            # records checksums for the manifest, over a storage whose every write the watchdog sees
            storage=integrity.ChecksummingStorage(WatchedStorage(target, monitor), tag, coord.rank),
            tag=tag,
            seq=self._seq,
            created_at=created_at,
            topology=topo,
            zero1=zero1,
            use_xser=use_xser,
            num_kept_ckpts=num_kept_ckpts,
            items=items,
            timeout_s=timeout_s,
            monitor=monitor,
            sharding=sharding,
            resave_of=storage if resave else None,
            durable=durable,
        )

    def _write_and_commit(
        self,
        ctx: _SaveContext,
        coord: Coordinator,
        staged: list[plan.StateWrite],
        report: SaveReport,
        waves: int | None,
        lease: staging.StagedState | None = None,
        fetcher: staging.HostFetcher | None = None,
    ) -> None:
        """Write this rank's files, then run the commit protocol. ``waves`` bounds concurrent writers per
        host for synchronous saves (it uses barriers); background writes pass None (no collectives).
        ``lease`` (async saves) returns the staging buffers to the pool as soon as the files are written;
        ``fetcher`` (synchronous saves of device tensors) hands the writers host copies as they arrive."""
        barrier = self._barrier(ctx, coord)
        write_start = time.perf_counter()
        error: BaseException | None = None

        def write_files() -> None:
            if ctx.tier is not None:
                write_tiers(ctx.tier)
                return
            # All of this rank's files are fsynced together at the end (one flush, not one per state file).
            with ctx.storage.durability_batch():
                written = write_all(ctx.storage)
            ctx.storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
            ctx.storage.write_manifest()  # before arriving: 'done' implies every rank's manifest exists
            report.files_written = len(written)

        def write_tiers(tier: TierSave) -> None:
            # Node memory first (the copy every other tier is made from), then the peers, then durable storage.
            tier.begin()
            written = write_all(tier.storage)
            if coord.rank == 0:  # the metadata a restore from memory needs (durable storage gets it at 'done')
                write_metadata(tier.storage, self._metadata(ctx, coord.world_size))
            tier.seal()
            if lease is not None:  # the state is in node memory: the staging buffers can be reused
                lease.release()
            tier.replicate()
            if ctx.durable:
                tier.copy_to(ctx.storage)
                ctx.storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
                ctx.storage.write_manifest()
            report.files_written = len(written)

        def write_all(target: Storage) -> list[str]:
            written: list[str] = []
            for w in staged:
                if w.is_state_file:
                    done = statefile.write_state_file(
                        target,
                        w.path,
                        w.state,
                        xser_encoding=w.xser,
                        replicas=w.replicas,
                        rank=coord.rank,
                        host=fetcher.host if fetcher is not None else None,
                    )
                    written += done.paths
                    report.bytes_written += done.nbytes
                    continue
                written += statefile.write_plain(
                    target, w.path, w.state, host=fetcher.host if fetcher is not None else None
                )
                report.bytes_written += sum(t.numel() * t.element_size() for t in _tensors(w.state))
            return written

        def watched_write() -> None:
            # On a helper thread watched for stalls and overdue files: a storage call that never returns
            # raises here (naming the file and the bytes moved) instead of hanging this rank.
            ctx.monitor.reset(f"writing {ctx.tag!r} on rank {coord.rank}")
            run_watched(write_files, ctx.monitor)

        if waves is not None and coord.distributed and waves < ctx.topology.local_world_size:
            try:
                coord.in_waves(
                    waves, ctx.topology.local_rank, ctx.topology.local_world_size, watched_write, f"writing {ctx.tag!r}"
                )
            except BaseException as e:
                error = e
        else:
            try:
                watched_write()
            except BaseException as e:
                error = e
        report.write_s = time.perf_counter() - write_start
        if error is not None:
            mark_origin(error, coord.rank)
        if lease is not None:
            lease.release()
            if ctx.monitor.cancelled:  # an abandoned writer thread may still read them: never reuse them
                self._staging_pool.clear()
        try:
            barrier.arrive(error)
        except Exception as store_error:
            if error is None:
                raise
            # The store is gone (rank 0 gave up and exited): this rank's own failure is what the caller needs.
            logger.warning("rank %d could not report its failure to rank 0's commit: %s", coord.rank, store_error)
            raise error from store_error

        if coord.rank == 0:
            commit_error: BaseException | None = None
            try:
                failures = barrier.wait_all_arrived()
            except CheckpointTimeoutError as e:  # ranks that never arrived: the save fails, on every rank
                failures, commit_error = {}, e
            if not failures and commit_error is None and ctx.durable:
                try:
                    ctx.monitor.reset(f"committing {ctx.tag!r} on rank 0")
                    run_watched(lambda: self._write_done(ctx, coord.world_size), ctx.monitor, "nxd_ckpt_commit")
                except BaseException as e:
                    commit_error = e
            outcome: RankFailure | None = None
            if commit_error is not None:
                outcome = RankFailure.of(commit_error, 0, barrier.phase)
            elif failures:
                first, *others = sorted(failures)
                outcome = failures[first]
                if others:
                    outcome = dataclasses.replace(
                        outcome, message=f"{outcome.message} (rank(s) {others} failed too; see their logs)"
                    )
            barrier.publish_outcome(outcome)
            report.total_s = time.perf_counter() - report._started
            if error is not None:
                raise error
            if commit_error is not None:
                mark_origin(commit_error, 0)
                raise commit_error
            if outcome is not None:  # another rank failed: the same exception type as there
                raise outcome.to_exception()
            report.completed = True
        else:
            if error is not None:
                raise error
            # Async saves wait here too (on the writer thread, polling the store), so a failure on any rank
            # is raised on every rank by its next save/finalize.
            barrier.wait_outcome()
            report.total_s = time.perf_counter() - report._started
            report.completed = True

    def _apply_retention(self, ctx: _SaveContext) -> None:
        """Rank 0, after ``done``: delete what ``num_kept_ckpts`` no longer keeps (never raises)."""
        if ctx.num_kept_ckpts is None:
            return
        deleted = tags.apply_retention(ctx.storage, ctx.num_kept_ckpts, protect={ctx.tag})
        if deleted:
            logger.info("retention deleted %s", ", ".join(deleted))

    def _retention_after(self, ctx: _SaveContext, report: SaveReport) -> None:
        """Writer job queued behind an async save: retention, only if that save was committed."""
        if report.completed:
            self._apply_retention(ctx)

    def _metadata(self, ctx: _SaveContext, world_size: int) -> TagMetadata:
        topo = ctx.topology
        return TagMetadata(
            tag=ctx.tag,
            created_at=ctx.created_at,
            tp=topo.tp_size,
            pp=topo.pp_size,
            dp=topo.dp_size,
            cp=topo.cp_size,
            ep=topo.ep_size,
            world_size=world_size,
            zero1=ctx.zero1,
            zero1_dp_size=topo.zero1_size if ctx.zero1 else None,
            xser=ctx.use_xser,
            items=ctx.items,
            torch_version=torch.__version__,
            sharding=ctx.sharding,
        )

    def _write_done(self, ctx: _SaveContext, world_size: int) -> None:
        write_metadata(ctx.storage, self._metadata(ctx, world_size))
        ctx.storage.write_manifest()  # rank 0's manifest again, now listing the metadata file too
        ctx.storage.sync_dirs([ctx.tag, ""])  # the tag's entries are durable before 'done' can be
        ctx.storage.write_bytes(layout.tag_path(ctx.tag, layout.DONE_MARKER), b"1")
        ctx.storage.sync_dirs([ctx.tag])  # 'done' is durable before retention deletes older tags
        if ctx.resave_of is not None:  # the complete re-save takes the tag's name from the old checkpoint
            tags.swap_in_resave(ctx.resave_of, ctx.tag)

    def _log_save(self, report: SaveReport, coord: Coordinator) -> None:
        """One INFO line per save, on the master rank (async saves: when the commit outcome is known)."""
        if coord.rank == 0:
            logger.info("%s", report.summary())

    # ----------------------------------------------------------------- load
    def load(
        self,
        checkpoint_dir: str | os.PathLike[str],
        tag: str | None = None,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        num_workers: int = 8,
        strict: bool = True,
        allow_pickle: bool = False,
        rank_state: Any = None,
        skip_rank_state: bool = False,
        device: str | torch.device | None = None,
        verify: bool = True,
        fallback_to_verified: bool = False,
        timeout: float | None = None,
        sharding: Any = None,
        *,
        memory_tier: MemoryTier | None = None,
    ) -> Any:
        resolve_timeout(timeout)  # a bad timeout fails before anything else
        tier = self._resolve_tier(memory_tier)
        if tier is not None:
            options = dict(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                num_workers=num_workers,
                strict=strict,
                allow_pickle=allow_pickle,
                rank_state=rank_state,
                skip_rank_state=skip_rank_state,
                device=device,
                verify=verify,
                fallback_to_verified=fallback_to_verified,
                timeout=timeout,
                sharding=sharding,
            )
            return self._load_tiers(checkpoint_dir, tag, tier, options)
        return self._load_dir(
            checkpoint_dir, tag, model, optimizer, scheduler, num_workers, strict, allow_pickle, rank_state,
            skip_rank_state, device, verify, fallback_to_verified, timeout, sharding,
        )  # fmt: skip

    def _load_dir(
        self,
        checkpoint_dir: str | os.PathLike[str] | Storage,
        tag: str | None,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        num_workers: int,
        strict: bool,
        allow_pickle: bool,
        rank_state: Any,
        skip_rank_state: bool,
        device: str | torch.device | None,
        verify: bool,
        fallback_to_verified: bool,
        timeout: float | None,
        sharding: Any = None,
    ) -> Any:
        """A load from one checkpoint directory (or one memory-tier view, a Storage)."""
        timeout_s = resolve_timeout(timeout)
        if fallback_to_verified and tag is None:
            options = dict(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                num_workers=num_workers,
                strict=strict,
                allow_pickle=allow_pickle,
                rank_state=rank_state,
                skip_rank_state=skip_rank_state,
                device=device,
                timeout=timeout,
                sharding=sharding,
            )
            return self._load_newest_verified(checkpoint_dir, options)
        coord = self.coordinator()
        with coord.deadline(timeout_s):
            return self._load(
                coord, checkpoint_dir, tag, model, optimizer, scheduler, num_workers, strict, allow_pickle,
                rank_state, skip_rank_state, device, verify, sharding,
            )  # fmt: skip

    def _load(
        self,
        coord: Coordinator,
        checkpoint_dir: str | os.PathLike[str],
        tag: str | None,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        num_workers: int,
        strict: bool,
        allow_pickle: bool,
        rank_state: Any,
        skip_rank_state: bool,
        device: str | torch.device | None,
        verify: bool,
        sharding_spec: Any = None,
    ) -> Any:
        call_start = time.perf_counter()
        target_device = xla.resolve_device(device)  # before any collective: a missing torch_xla fails fast
        self.check_for_errors()
        self.wait_pending()
        self.check_for_errors()
        topo = coord.run_all(self.topology, "reading the parallel layout")
        storage = checkpoint_dir if isinstance(checkpoint_dir, TierView) else self._storage_for(checkpoint_dir)

        def resolve() -> tuple[str, TagDescription]:
            tags.recover_resaves(storage, finish_only=True)  # a crash mid-swap: the complete copy gets its name
            resolved = tags.resolve_tag(storage, tag)
            return resolved, describe(storage, resolved)

        resolved, info = coord.master_computes(resolve, f"resolving the checkpoint to load from {storage.url}")
        if verify:  # every file read below is checked against the manifests written with it (integrity.py)
            index = coord.master_computes(
                lambda: integrity.read_index(storage, resolved), f"reading the manifests of {resolved!r}"
            )
            storage = integrity.VerifyingStorage(storage, resolved, index)
        resharded = None
        if _check_layout(info, topo, storage.url, resolved) and (model is not None or optimizer is not None):
            resharded = self._plan_reshard(
                coord, storage, resolved, info, topo, model, optimizer, strict, allow_pickle, sharding_spec
            )

        # DP replicas reading the same xser file share the reads; only when all replicas load in one wave.
        replicas = None
        if (model is not None or optimizer is not None) and num_workers >= topo.local_world_size:
            replicas = replica_reads.replica_groups(coord, topo)

        def read_and_apply() -> Any:
            if resharded is not None:  # another TP/PP layout: every tensor assembled from the parts it covers
                where = f"{storage.url}/{resolved}"
                if model is not None:
                    state = resharded.model_state()
                    adapters.load_model_state(model, state, strict=strict, source=where, device=target_device)
                if optimizer is not None:
                    state = resharded.optimizer_state()
                    adapters.load_optimizer_state(optimizer, state, source=where, device=target_device)
            elif model is not None:
                path = layout.model_file(resolved, topo.tp_rank, topo.pp_rank, topo.file_ep_rank)
                # Straight into the live model's tensors (no second copy), checked against it first.
                target = adapters.load_target(model, "model", strict=strict, source=f"{storage.url}/{path}")
                state = _read(storage, path, info, allow_pickle, replicas, target)
                adapters.load_model_state(
                    model, state, strict=strict, source=f"{storage.url}/{path}", device=target_device
                )
            if optimizer is not None and resharded is None:
                if info.zero1:
                    path = layout.optim_file(resolved, topo.zero1_rank, topo.tp_rank, topo.pp_rank)
                else:
                    path = layout.optim_file(resolved, 0, topo.tp_rank, topo.pp_rank, topo.file_ep_rank)
                reshard, saved_dp = zero1_io.reshard_source(info, topo)
                if reshard and topo.expert_parallel:
                    raise LayoutMismatchError(
                        f"checkpoint {storage.url}/{resolved} holds ZeRO-1 state for {saved_dp or 'full'} shards but "
                        f"this job runs {topo.describe()}: re-sharding ZeRO-1 state under expert parallelism (expert "
                        "parameters shard over expert-data-parallel groups) is not supported; use the saved DP size"
                    )
                if reshard:  # ZeRO-1 saved with another DP size (or full): read only the rows this shard covers
                    state = zero1_io.load_resharded_state(storage, resolved, saved_dp, topo, trusted=allow_pickle)
                else:
                    target = adapters.load_target(optimizer, "optimizer")
                    state = _read(storage, path, info, allow_pickle, None if info.zero1 else replicas, target)
                adapters.load_optimizer_state(optimizer, state, source=f"{storage.url}/{path}", device=target_device)
            if scheduler is not None:
                path = layout.tag_path(resolved, layout.SCHEDULER_FILE)
                state = _read(storage, path, info, allow_pickle)
                adapters.load_scheduler_state(scheduler, state, source=f"{storage.url}/{path}", device=target_device)
            path = layout.tag_path(resolved, layout.USER_CONTENT_FILE)
            if storage.exists(path):
                return statefile.read_plain(storage, path, trusted=allow_pickle)
            return None

        start = time.perf_counter()
        result = coord.in_waves(
            num_workers, topo.local_rank, topo.local_world_size, read_and_apply, f"loading {resolved!r}"
        )
        if not skip_rank_state:  # data loaders and RNG last: nothing after them may draw random numbers
            rank_states.restore(coord, storage, resolved, topo, rank_state, trusted=allow_pickle)
        if coord.rank == 0:  # one line per load, on the master: bytes, time, throughput, time training waited
            elapsed, nbytes = time.perf_counter() - start, _loaded_bytes(model, optimizer)
            logger.info(
                "loaded %s from %s: %s on this rank in %.2f s (%s), training blocked %.2f s",
                resolved,
                storage.url,
                format_bytes(nbytes),
                elapsed,
                format_rate(nbytes, elapsed),
                time.perf_counter() - call_start,
            )
        return result

    def _load_tiers(
        self, checkpoint_dir: str | os.PathLike[str], tag: str | None, tier: MemoryTier, options: dict[str, Any]
    ) -> Any:
        """The newest complete checkpoint across tiers (or ``tag``): this node's memory, else copies fetched from
        other nodes, else the checkpoint directory. Every rank takes the same decision (one rule applied to the
        gathered reports and rank 0's durable listing); a copy that fails verification anywhere sends every rank
        to the next tier. Logs (rank 0) where each rank's state came
        from; ``last_restore`` holds it."""
        coord = self.coordinator()
        self.check_for_errors()
        self.wait_pending()
        self.check_for_errors()
        timeout_s = resolve_timeout(options.get("timeout"))
        storage = self._storage_for(checkpoint_dir)
        with coord.deadline(timeout_s):
            topo = coord.run_all(self.topology, "reading the parallel layout")
            runtime = self._tier(tier, storage.url, coord, topo)
            reports = coord.all_gather_object(runtime.report(), phase="memory tier: what each node holds")

            def durable_newest() -> tuple[str, float] | None:
                if tag is not None:
                    return None
                tags.recover_resaves(storage, finish_only=True)
                listed = tags.list_tags(storage)
                return (listed[-1].name, listed[-1].order_time) if listed else None

            choice = choose_memory_tag(reports, tag)
            durable = coord.master_computes(durable_newest, f"listing the checkpoints in {storage.url}")
        failures: list[str] = []
        if choice is not None and (durable is None or choice.created_at >= durable[1] or durable[0] == choice.tag):
            view: TierView | None = runtime.view(choice, reports, prefer_remote=False)
            damaged = False
            for attempt in ("local", "peer"):
                if attempt == "peer":
                    # Ranks that found damage read every share from another node's copy; the others keep theirs.
                    if damaged:
                        view = runtime.view(choice, reports, prefer_remote=True)
                    with coord.deadline(timeout_s):
                        ready = coord.all_gather_object(view is not None, phase="memory tier: other copies")
                    if not all(ready):
                        break
                assert view is not None
                result, error = None, None
                try:
                    # a tier copy counts only verified: every file read is checked against its manifest
                    verified = {**options, "fallback_to_verified": False, "verify": True}
                    result = self._load_dir(view, choice.tag, **verified)
                except Exception as e:
                    error = e
                damaged = isinstance(error, FormatError)
                where = "peer" if view.bytes_remote else "memory"
                verdict = None if error is None else ("damaged" if damaged else type(error).__name__)
                # the load's steps raise one rank's damage on every rank: only the rank that found it changes copy
                damaged = damaged and getattr(error, "origin_rank", coord.rank) == coord.rank
                with coord.deadline(timeout_s):
                    verdicts = coord.all_gather_object(
                        (verdict, str(error) if damaged else None, where),
                        phase=f"memory tier: agreeing whether {choice.tag!r} loaded",
                    )
                if all(v is None for v, _, _ in verdicts):
                    self.last_restore = RestoreReport(choice.tag, [w for _, _, w in verdicts])
                    if coord.rank == 0:
                        logger.info("restored %s from the memory tier (%s)", choice.tag, self.last_restore.summary())
                    return result
                if any(v not in (None, "damaged", "RemoteRankError") for v, _, _ in verdicts):
                    if error is not None:
                        raise error
                    raise RemoteRankError(
                        f"loading {choice.tag} from the memory tier failed on another rank: {verdicts}"
                    )
                reason = next(msg for v, msg, _ in verdicts if v == "damaged")
                failures.append(f"{attempt} copy: {reason}")
                if coord.rank == 0:
                    logger.warning(
                        "the %s copy of checkpoint %s in the memory tier failed verification (%s); trying the "
                        "next tier",
                        attempt,
                        choice.tag,
                        reason,
                    )
        elif choice is None and coord.rank == 0:
            logger.info("no complete checkpoint%s in the memory tier; loading from %s",
                        f" {tag!r}" if tag else "", storage.url)  # fmt: skip
        result = self._load_dir(checkpoint_dir, tag, **options)
        self.last_restore = RestoreReport(tag or tags.latest_tag(storage) or "", ["durable"] * coord.world_size)
        if coord.rank == 0:
            logger.info("restored %s from %s (durable)%s", self.last_restore.tag, storage.url,
                        " after: " + " | ".join(failures) if failures else "")  # fmt: skip
        return result

    def _plan_reshard(
        self,
        coord: Coordinator,
        storage: Storage,
        tag: str,
        info: TagDescription,
        topo: Topology,
        model: Any,
        optimizer: Any,
        strict: bool,
        allow_pickle: bool,
        sharding_spec: Any,
    ) -> reshard.ReshardedLoad:
        """Every rank's plan of a load at another TP/PP size, checked on all ranks before anything is read."""
        saved = info.metadata.sharding if info.metadata is not None else None
        if saved is None and sharding_spec is None:
            raise LayoutMismatchError(
                f"checkpoint {storage.url}/{tag} was saved with TP={info.tp} PP={info.pp} but this job runs "
                f"{topo.describe()}, and it records no sharding (written by NxD, an older nxd_ckpt, or from a "
                "dict): pass sharding= to load_checkpoint (name patterns -> partition dim, or a model whose "
                "parameters carry NxD's attributes) to re-shard it, or load it with the same TP and PP sizes "
                "(DP may differ)"
            )

        def plan() -> reshard.ReshardedLoad:
            record = reshard.source_record(storage, tag, info, saved, sharding_spec, trusted=allow_pickle)
            return reshard.ReshardedLoad(
                storage, tag, info, record, topo, model, optimizer, strict=strict, trusted=allow_pickle
            )

        return coord.run_all(plan, f"planning the load of {tag!r} at another parallel layout")

    def _load_newest_verified(self, checkpoint_dir: str | os.PathLike[str], options: dict[str, Any]) -> Any:
        """Auto-latest load that skips, newest first, complete tags failing verification (logged as WARNING).

        A tag is skipped when any rank found one of its files damaged or missing (FormatError, which includes
        IntegrityError); every other error is raised. All ranks agree on each attempt's outcome.
        """
        options = {**options, "verify": True, "fallback_to_verified": False}  # one verified load per candidate
        coord = self.coordinator()
        storage = self._storage_for(checkpoint_dir)

        def newest_first() -> list[str]:
            tags.recover_resaves(storage, finish_only=True)
            return [t.name for t in reversed(tags.list_tags(storage))]

        with coord.deadline(resolve_timeout(options.get("timeout"))):
            candidates = coord.master_computes(newest_first, f"listing the checkpoints in {storage.url}")
        if not candidates:
            tags.resolve_tag(storage, None)  # raises CheckpointNotFoundError, naming incomplete tags
        failures: list[str] = []
        for candidate in candidates:
            result, error = None, None
            try:
                result = self._load_dir(checkpoint_dir, candidate, **options)
            except Exception as e:
                error = e
            damaged = isinstance(error, FormatError)
            verdict = None if error is None else ("damaged" if damaged else type(error).__name__)
            with coord.deadline(resolve_timeout(options.get("timeout"))):
                verdicts = coord.all_gather_object(
                    (verdict, str(error) if damaged else None), phase=f"agreeing whether {candidate!r} loaded"
                )
            if all(v is None for v, _ in verdicts):
                if failures and coord.rank == 0:
                    logger.warning("loaded %s from %s after skipping damaged checkpoints", candidate, storage.url)
                return result
            if not any(v == "damaged" for v, _ in verdicts) or any(
                v not in (None, "damaged", "RemoteRankError") for v, _ in verdicts
            ):
                if error is not None:
                    raise error
                raise RemoteRankError(f"loading {candidate} failed on another rank: {verdicts}")
            reason = next(msg for v, msg in verdicts if v == "damaged")
            failures.append(f"{candidate}: {reason}")
            if coord.rank == 0:
                logger.warning(
                    "CHECKPOINT %s IN %s FAILED VERIFICATION AND IS SKIPPED: %s; falling back to the previous "
                    "complete checkpoint",
                    candidate,
                    storage.url,
                    reason,
                )
        raise IntegrityError(f"no complete checkpoint in {storage.url} passes verification: " + " | ".join(failures))


def _tensors(state: Any) -> list[torch.Tensor]:
    from nxd_ckpt.tree import iter_tensors

    return [t for _, t in iter_tensors(state)]


def _loaded_bytes(*targets: Any) -> int:
    """Tensor bytes now held by the load targets (modules/optimizers via state_dict, dicts as they are)."""
    states = [t.state_dict() if hasattr(t, "state_dict") else t for t in targets if t is not None]
    return sum(t.numel() * t.element_size() for state in states for t in _tensors(state))


def _read(
    storage: Storage,
    path: str,
    info: TagDescription,
    allow_pickle: bool,
    replicas: replica_reads.ReplicaGroup | None = None,
    target: statefile.LoadTarget | None = None,
) -> Any:
    if not storage.exists(path):
        tag_dir, _, rest = path.partition("/")
        if rest.startswith(layout.OPTIM_DIR + "/") and storage.exists(
            layout.tag_path(tag_dir, layout.OPTIM_DIR, layout.DCP_METADATA_FILE)
        ):
            raise FormatError(
                f"{storage.url}/{tag_dir}/{layout.OPTIM_DIR} holds ZeRO-1 state in torch Distributed Checkpoint format "
                "(NxD's use_zero1_dcp=True), which nxd_ckpt does not read; load the model without the optimizer, or "
                "re-save the optimizer state with use_zero1_dcp=False"
            )
        raise FormatError(
            f"checkpoint file {storage.url}/{path} is missing; the checkpoint is damaged or was saved "
            "without this state (load without it, or pick another tag)"
        )
    state = statefile.read_state_file(storage, path, trusted=allow_pickle, group=replicas, target=target)
    return target.finish(state) if target is not None else state


def _record_sharding(
    coord: Coordinator, topo: Topology, model: Any, model_sd: Any, optimizer: Any
) -> ShardingRecord | None:
    """Rank 0: how every model tensor of every PP stage is sharded (each stage's first replica of TP rank 0
    describes its stage; a collective). None, with a warning, when it cannot be recorded (the checkpoint is
    then still saved, only not re-shardable without a sharding spec)."""
    local: ShardingRecord | str | None = None
    if topo.tp_rank == 0 and topo.replica_rank == 0:
        try:
            local = sharding.record_for_save(model, model_sd, optimizer, topo.tp_size, topo.pp_rank)
        except Exception as e:  # never fail (or hang) a save over the record: every rank reaches the gather
            local = f"rank {coord.rank}: {e}"
    gathered = coord.gather_object(local, phase="recording how the model is sharded")
    if gathered is None:
        return None
    problems = [g for g in gathered if isinstance(g, str)]
    try:
        if problems:
            raise ValueError("; ".join(problems))
        merged = ShardingRecord.merge(g for g in gathered if isinstance(g, ShardingRecord))
        return merged if merged.tensors else None  # e.g. a dict at TP > 1: nothing known, nothing recorded
    except Exception as e:
        logger.warning(
            "the sharding of the model could not be recorded (%s): loads at another layout will need sharding=", e
        )
        return None


def describe_checkpoint(storage: Storage, tag: str) -> TagDescription:
    """Layout facts of a saved tag (kept for callers of the old name): ``format.describe.describe``."""
    return describe(storage, tag)


def _check_layout(info: TagDescription, topo: Topology, url: str, tag: str) -> bool:
    """Whether the load changes the TP or PP size (re-sharded on load); raises for what cannot change."""
    if info.tp is None:
        return False
    if info.ep != topo.ep_size:
        raise LayoutMismatchError(
            f"checkpoint {url}/{tag} was saved with expert parallelism EP={info.ep} but this job runs "
            f"{topo.describe()}; load it with the same EP size (experts are not re-sharded)"
        )
    if (info.tp, info.pp) != (topo.tp_size, topo.pp_size) and (info.ep > 1 or topo.expert_parallel):
        raise LayoutMismatchError(
            f"checkpoint {url}/{tag} was saved with TP={info.tp} PP={info.pp} EP={info.ep} but this job runs "
            f"{topo.describe()}; re-sharding under expert parallelism is not supported: load it with the same "
            "TP and PP sizes (DP may differ)"
        )
    return (info.tp, info.pp) != (topo.tp_size, topo.pp_size)
