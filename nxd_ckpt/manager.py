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
import json
import logging
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from . import adapters, integrity, layout, plan, staging, statefile, tags, xla, zero1_io
from . import rank_state as rank_states
from .commit import CommitBarrier
from .dist import Coordinator, format_exception
from .errors import (
    CheckpointError,
    FormatError,
    IntegrityError,
    LayoutMismatchError,
    RemoteRankError,
)
from .parallel_state import current_topology
from .storage import Storage, storage_for
from .topology import Topology
from .writer import AsyncWriter

logger = logging.getLogger("nxd_ckpt")

FORMAT_VERSION = 1


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
            f"saved {self.tag} ({mode}): {self.bytes_written / 1e6:.1f} MB on this rank, training blocked "
            f"{self.blocked_s:.3f} s{waited}, staging {self.staging_s:.3f} s, write {self.write_s:.2f} s "
            f"({self.throughput_gbps:.2f} GB/s), durable after {self.total_s:.2f} s"
        )

    def wait(self) -> SaveReport:
        """Block until this save is durable on this rank (re-raises its error)."""
        if self._future is not None:
            self._future.result()
        return self


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
    resave_of: Storage | None = None
    """Set when the tag already held a complete checkpoint: this save is written beside it (tags.ResaveStorage)
    and swapped in by rank 0's commit; the storage the swap happens in."""
    state_files: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Model/optimizer files this rank writes -> the ranks holding that state (xser spreads the work over them)."""


class CheckpointManager:
    """Per-process owner of everything a save or load needs between calls. One per process is typical."""

    def __init__(self) -> None:
        self._coordinator: Coordinator | None = None
        self._coordinator_key: tuple | None = None
        self._session: str | None = None
        self._seq = 0
        self._async_writer: AsyncWriter | None = None
        self._staging_pool = staging.StagingPool(max_sets=2)

    # ----------------------------------------------------------------- plumbing
    def coordinator(self) -> Coordinator:
        """The coordinator for the current process group (re-created if the group changed)."""
        import torch.distributed as dist

        key = (dist.is_initialized(), id(dist.group.WORLD) if dist.is_initialized() else None)
        if self._coordinator is None or key != self._coordinator_key:
            self._coordinator = Coordinator()
            self._coordinator_key = key
            session = uuid.uuid4().hex[:12] if self._coordinator.rank == 0 else None
            self._session = self._coordinator.broadcast_object(session)
            self._seq = 0
        return self._coordinator

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
    ) -> SaveReport:
        call_start = time.perf_counter()
        layout.validate_tag(tag)
        if num_kept_ckpts is not None and (not isinstance(num_kept_ckpts, int) or num_kept_ckpts < 1):
            raise ValueError(f"num_kept_ckpts must be None or an integer >= 1, got {num_kept_ckpts!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        self.check_for_errors()
        waited = self.wait_pending()
        self.check_for_errors()

        coord = self.coordinator()
        if waited >= 0.001 and coord.rank == 0:
            logger.info("save of %s waited %.2f s for the previous save to finish writing", tag, waited)
        topo = current_topology()
        storage = storage_for(checkpoint_dir)
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
        ctx = self._begin(coord, storage, tag, topo, zero1, use_xser, num_kept_ckpts, items)

        report = SaveReport(tag=tag, checkpoint_dir=storage.url, async_save=async_save, waited_s=waited)
        report._started = call_start
        stage_start = time.perf_counter()
        writes = plan.plan_save(
            topo,
            tag,
            model=adapters.model_state(model) if model is not None else None,
            optimizer=adapters.optimizer_state(optimizer) if optimizer is not None else None,
            scheduler=adapters.scheduler_state(scheduler) if scheduler is not None else None,
            user_content=user_content,
            zero1=zero1,
            spread_replicated=use_xser,
        )
        ctx.state_files.update({w.path: w.replicas for w in writes if w.kind in ("model", "optimizer")})
        lease: staging.StagedState | None = None
        fetcher: staging.HostFetcher | None = None
        if async_save:  # a training-safe copy in reused host buffers, handed back once the files are durable
            try:
                needed = {id(t) for t in self._tensors_to_write(writes, ctx, coord.rank)}
                lease = self._staging_pool.stage([w.state for w in writes], needed=needed)
            except BaseException as e:
                # Tell rank 0's commit that this rank will never write, instead of letting it wait until timeout.
                barrier = CommitBarrier(coord.store, str(self._session), ctx.seq, coord.rank, coord.world_size)
                barrier.arrive(f"rank {coord.rank} could not stage its state: {format_exception(e)}")
                raise
            staged = [(w.path, state) for w, state in zip(writes, lease.trees, strict=True)]
            report.staging_allocated_bytes = lease.allocated_bytes
        else:
            # Device tensors are copied to the host by a thread running ahead of the writers (one sync for all).
            staged = [(w.path, w.state) for w in writes]
            if any(staging.has_device_tensors(w.state) for w in writes):
                try:
                    fetcher = staging.HostFetcher(self._tensors_to_write(writes, ctx, coord.rank))
                except BaseException as e:  # as for async staging: rank 0's commit must not wait for this rank
                    barrier = CommitBarrier(coord.store, str(self._session), ctx.seq, coord.rank, coord.world_size)
                    barrier.arrive(f"rank {coord.rank} could not copy its state to the host: {format_exception(e)}")
                    raise
        staged += rank_files
        report.staging_s = time.perf_counter() - stage_start

        def write_and_commit() -> None:
            try:
                self._write_and_commit(
                    ctx, coord, staged, report, num_workers if not async_save else None, lease, fetcher
                )
            finally:
                if fetcher is not None:
                    fetcher.close()
            if async_save:
                self._log_save(report, coord)

        if async_save:
            writer = self._writer()
            report.blocked_s = time.perf_counter() - call_start  # set first: the job logs it
            report._future = writer.submit(write_and_commit, name=f"save {tag}")
            if coord.rank == 0 and num_kept_ckpts is not None:
                writer.submit(lambda: self._retention_after(ctx, report), name=f"retention after {tag}")
            report.blocked_s = time.perf_counter() - call_start
        else:
            write_and_commit()
            report.blocked_s = time.perf_counter() - call_start
            self._log_save(report, coord)
        return report

    @staticmethod
    def _tensors_to_write(writes: list[plan.StateWrite], ctx: _SaveContext, rank: int) -> list[torch.Tensor]:
        """The tensors this rank's writers will read, in order: with xser, only its share of replicated files."""
        return [
            t
            for w in writes
            for t in statefile.tensors_to_write(
                w.state,
                xser_encoding=ctx.use_xser and w.path in ctx.state_files,
                replicas=ctx.state_files.get(w.path),
                rank=rank,
            )
        ]

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
    ) -> _SaveContext:
        """Rank 0 marks the tag as being saved (a complete one is re-saved beside it); all ranks agree on the save."""

        def prepare() -> tuple[float, bool]:
            if coord.rank != 0:
                return 0.0, False
            tags.recover_resaves(storage)  # a re-save a crash interrupted is finished or dropped first
            if storage.exists(layout.tag_path(tag, layout.DONE_MARKER)):
                # The tag holds a complete checkpoint: write the new one beside it and swap it in once it is
                # complete (tags.swap_in_resave), so the old one stays loadable until then.
                tags.begin_resave(storage, tag)
                return time.time(), True
            # A new tag, or the leftovers of an interrupted save of it: rewritten in place.
            storage.delete(layout.tag_path(tag, layout.METADATA_FILE))
            integrity.remove_manifests(storage, tag)  # stale ones (e.g. another world size) would fail verify
            storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
            return time.time(), False

        created_at, resave = coord.broadcast_object(coord.run_all(prepare, f"starting checkpoint {tag!r}"))
        self._seq += 1
        target = tags.ResaveStorage(storage, tag) if resave else storage
        return _SaveContext(
            storage=integrity.ChecksummingStorage(target, tag, coord.rank),  # records checksums for the manifest
            tag=tag,
            seq=self._seq,
            created_at=created_at,
            topology=topo,
            zero1=zero1,
            use_xser=use_xser,
            num_kept_ckpts=num_kept_ckpts,
            items=items,
            resave_of=storage if resave else None,
        )

    def _write_and_commit(
        self,
        ctx: _SaveContext,
        coord: Coordinator,
        staged: list[tuple[str, Any]],
        report: SaveReport,
        waves: int | None,
        lease: staging.StagedState | None = None,
        fetcher: staging.HostFetcher | None = None,
    ) -> None:
        """Write this rank's files, then run the commit protocol. ``waves`` bounds concurrent writers per
        host for synchronous saves (it uses barriers); background writes pass None (no collectives).
        ``lease`` (async saves) returns the staging buffers to the pool as soon as the files are written;
        ``fetcher`` (synchronous saves of device tensors) hands the writers host copies as they arrive."""
        barrier = CommitBarrier(coord.store, str(self._session), ctx.seq, coord.rank, coord.world_size)
        write_start = time.perf_counter()
        error: BaseException | None = None

        def write_files() -> None:
            # All of this rank's files are fsynced together at the end (one flush, not one per state file).
            deferred = getattr(ctx.storage, "deferred_fsync", None)
            with deferred() if callable(deferred) else contextlib.nullcontext():
                written = write_all()
            ctx.storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
            ctx.storage.write_manifest()  # before arriving: 'done' implies every rank's manifest exists
            report.files_written = len(written)

        def write_all() -> list[str]:
            written: list[str] = []
            for path, state in staged:
                if path in ctx.state_files:
                    done = statefile.write_state_file(
                        ctx.storage,
                        path,
                        state,
                        xser_encoding=ctx.use_xser,
                        replicas=ctx.state_files[path],
                        rank=coord.rank,
                        host=fetcher.host if fetcher is not None else None,
                    )
                    written += done.paths
                    report.bytes_written += done.nbytes
                    continue
                written += statefile.write_plain(
                    ctx.storage, path, state, host=fetcher.host if fetcher is not None else None
                )
                report.bytes_written += sum(t.numel() * t.element_size() for t in _tensors(state))
            return written

        if waves is not None and coord.distributed and waves < ctx.topology.local_world_size:
            try:
                coord.in_waves(waves, ctx.topology.local_rank, ctx.topology.local_world_size, write_files, "writing")
            except BaseException as e:
                error = e
        else:
            try:
                write_files()
            except BaseException as e:
                error = e
        report.write_s = time.perf_counter() - write_start
        if lease is not None:
            lease.release()
        barrier.arrive(None if error is None else f"rank {coord.rank}: {format_exception(error)}")

        if coord.rank == 0:
            errors = barrier.wait_all_arrived()
            commit_error: BaseException | None = None
            if not errors:
                try:
                    self._write_done(ctx, coord.world_size)
                except BaseException as e:
                    commit_error = e
            summary = "; ".join(errors[r] for r in sorted(errors)) if errors else None
            if commit_error is not None:
                summary = f"rank 0 could not commit: {format_exception(commit_error)}"
            if summary is None and ctx.num_kept_ckpts is not None and not report.async_save:
                # After 'done' (the commit), before the outcome, so a synchronous save returns on every rank
                # with retention applied; async saves run it as the next writer job (_retention_after).
                self._apply_retention(ctx)
            barrier.publish_outcome(summary)
            report.total_s = time.perf_counter() - report._started
            if error is not None:
                raise error
            if commit_error is not None:
                raise commit_error
            if summary is not None:
                raise CheckpointError(f"checkpoint {ctx.tag!r} was not completed: {summary}")
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

    def _write_done(self, ctx: _SaveContext, world_size: int) -> None:
        topo = ctx.topology
        metadata = {
            "format": "nxd_ckpt",
            "format_version": FORMAT_VERSION,
            "tag": ctx.tag,
            "created_at": ctx.created_at,
            "layout": {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size, "world_size": world_size},
            "zero1": ctx.zero1,
            "zero1_dp_size": topo.dp_size if ctx.zero1 else None,
            "xser": ctx.use_xser,
            "items": list(ctx.items),
            "torch_version": torch.__version__,
        }
        ctx.storage.write_bytes(layout.tag_path(ctx.tag, layout.METADATA_FILE), json.dumps(metadata, indent=1).encode())
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
    ) -> Any:
        if fallback_to_verified and tag is None:
            options = {k: v for k, v in locals().items() if k not in ("self", "checkpoint_dir", "tag")}
            return self._load_newest_verified(checkpoint_dir, options)
        call_start = time.perf_counter()
        target_device = xla.resolve_device(device)  # before any collective: a missing torch_xla fails fast
        self.check_for_errors()
        self.wait_pending()
        self.check_for_errors()
        coord = self.coordinator()
        topo = current_topology()
        storage = storage_for(checkpoint_dir)

        def resolve() -> tuple[str, dict]:
            tags.recover_resaves(storage, finish_only=True)  # a crash mid-swap: the complete copy gets its name
            resolved = tags.resolve_tag(storage, tag)
            return resolved, describe_checkpoint(storage, resolved)

        resolved, info = coord.broadcast_object(
            coord.run_all(resolve if coord.rank == 0 else lambda: None, "resolving")
        )
        if verify:  # every file read below is checked against the manifests written with it (integrity.py)
            index = coord.broadcast_object(
                coord.run_all(lambda: integrity.read_index(storage, resolved) if coord.rank == 0 else None, "verifying")
            )
            storage = integrity.VerifyingStorage(storage, resolved, index)
        _check_layout(info, topo, storage.url, resolved)

        # DP replicas reading the same xser file share the reads; only when all replicas load in one wave.
        replicas = None
        if (model is not None or optimizer is not None) and num_workers >= topo.local_world_size:
            replicas = statefile.replica_groups(coord, topo)

        def read_and_apply() -> Any:
            if model is not None:
                path = layout.model_file(resolved, topo.tp_rank, topo.pp_rank)
                state = _read(storage, path, info, allow_pickle, replicas)
                adapters.load_model_state(
                    model, state, strict=strict, source=f"{storage.url}/{path}", device=target_device
                )
            if optimizer is not None:
                dp = topo.dp_rank if info["zero1"] else 0
                path = layout.optim_file(resolved, dp, topo.tp_rank, topo.pp_rank)
                reshard, saved_dp = zero1_io.reshard_source(info, topo)
                if reshard:  # ZeRO-1 saved with another DP size (or full): read only the rows this shard covers
                    state = zero1_io.load_resharded_state(storage, resolved, saved_dp, topo, trusted=allow_pickle)
                else:
                    state = _read(storage, path, info, allow_pickle, None if info["zero1"] else replicas)
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
        result = coord.in_waves(num_workers, topo.local_rank, topo.local_world_size, read_and_apply, "loading")
        if not skip_rank_state:  # data loaders and RNG last: nothing after them may draw random numbers
            rank_states.restore(coord, storage, resolved, topo, rank_state, trusted=allow_pickle)
        if coord.rank == 0:  # one line per load, on the master: bytes, time, throughput, time training waited
            elapsed, nbytes = time.perf_counter() - start, _loaded_bytes(model, optimizer)
            logger.info(
                "loaded %s from %s: %.1f MB on this rank in %.2f s (%.2f GB/s), training blocked %.2f s",
                resolved,
                storage.url,
                nbytes / 1e6,
                elapsed,
                nbytes / elapsed / 1e9 if elapsed > 0 else 0.0,
                time.perf_counter() - call_start,
            )
        return result

    def _load_newest_verified(self, checkpoint_dir: str | os.PathLike[str], options: dict[str, Any]) -> Any:
        """Auto-latest load that skips, newest first, complete tags failing verification (logged as WARNING).

        A tag is skipped when any rank found one of its files damaged or missing (FormatError, which includes
        IntegrityError); every other error is raised. All ranks agree on each attempt's outcome.
        """
        options = {**options, "fallback_to_verified": False, "verify": True}
        coord = self.coordinator()
        storage = storage_for(checkpoint_dir)

        def newest_first() -> list[str]:
            tags.recover_resaves(storage, finish_only=True)
            return [t.name for t in reversed(tags.list_tags(storage))]

        candidates = coord.broadcast_object(coord.run_all(newest_first if coord.rank == 0 else list, "listing"))
        if not candidates:
            tags.resolve_tag(storage, None)  # raises CheckpointNotFoundError, naming incomplete tags
        failures: list[str] = []
        for candidate in candidates:
            result, error = None, None
            try:
                result = self.load(checkpoint_dir, candidate, **options)
            except Exception as e:
                error = e
            damaged = isinstance(error, FormatError)
            verdict = None if error is None else ("damaged" if damaged else type(error).__name__)
            verdicts = coord.all_gather_object((verdict, str(error) if damaged else None))
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
    from .tree import iter_tensors

    return [t for _, t in iter_tensors(state)]


def _loaded_bytes(*targets: Any) -> int:
    """Tensor bytes now held by the load targets (modules/optimizers via state_dict, dicts as they are)."""
    states = [t.state_dict() if hasattr(t, "state_dict") else t for t in targets if t is not None]
    return sum(t.numel() * t.element_size() for state in states for t in _tensors(state))


def _read(
    storage: Storage, path: str, info: dict, allow_pickle: bool, replicas: statefile.ReplicaGroup | None = None
) -> Any:
    if not storage.exists(path):
        raise FormatError(
            f"checkpoint file {storage.url}/{path} is missing; the checkpoint is damaged or was saved "
            "without this state (load without it, or pick another tag)"
        )
    return statefile.read_state_file(storage, path, trusted=allow_pickle, group=replicas)


def describe_checkpoint(storage: Storage, tag: str) -> dict:
    """Layout facts of a saved tag: from nxd_ckpt's metadata, else inferred from NxD's file names."""
    meta = tags.read_metadata(storage, tag) or {}
    model_coords = [
        c for n in storage.list_dir(layout.tag_path(tag, layout.MODEL_DIR)) if (c := layout.parse_state_file_name(n))
    ]
    optim_coords = [
        c for n in storage.list_dir(layout.tag_path(tag, layout.OPTIM_DIR)) if (c := layout.parse_state_file_name(n))
    ]
    coords = model_coords + optim_coords
    if "layout" in meta:
        tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    elif coords:
        tp, pp = max(c[1] for c in coords) + 1, max(c[2] for c in coords) + 1
    else:
        tp = pp = None
    full_coords = [  # ZeRO-1 optimizer states merged by the offline converter (optim/full_*.pt)
        c
        for n in storage.list_dir(layout.tag_path(tag, layout.OPTIM_DIR))
        if (c := layout.parse_full_optim_file_name(n))
    ]
    zero1_full = bool(meta.get("zero1_full", bool(full_coords) and not optim_coords))
    zero1 = meta.get("zero1", any(c[0] > 0 for c in optim_coords)) or zero1_full
    dp_saved = meta.get("zero1_dp_size") or (max(c[0] for c in optim_coords) + 1 if zero1 and optim_coords else None)
    return {
        "tp": tp,
        "pp": pp,
        "zero1": bool(zero1),
        "zero1_dp_size": dp_saved,
        "zero1_full": zero1_full,
        "metadata": meta or None,
    }


def _check_layout(info: dict, topo: Topology, url: str, tag: str) -> None:
    if info["tp"] is None:
        return
    if (info["tp"], info["pp"]) != (topo.tp_size, topo.pp_size):
        raise LayoutMismatchError(
            f"checkpoint {url}/{tag} was saved with TP={info['tp']} PP={info['pp']} but this job runs "
            f"{topo.describe()}; load it with the same TP and PP sizes (DP may differ)"
        )
