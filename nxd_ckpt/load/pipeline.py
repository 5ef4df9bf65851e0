"""The steps of one load, in the order the data takes them: resolve → describe → choose the read plan → read →
restore.

  resolve    rank 0 finds the tag (the latest complete one by default; a re-save a crash interrupted is
             finished first) and every rank learns it;
  describe   the tag's layout (``format.describe``) and, with ``verify``, its manifests: every file read below is
             checked against the checksums written with it (each rank receives the records of its own files);
  choose     the read plan: the same TP/PP layout (each rank reads its own files, DP replicas share reads), or
             re-sharded (``load.reshard``: each rank reads only the parts it holds now); and, around a whole
             load, the memory tier (this node, then peers, then the checkpoint directory) or
             ``fallback_to_verified`` (newest first, skipping tags that fail verification anywhere);
  read       model, optimizer, scheduler and user content, in waves of ``num_workers`` ranks per host;
  restore    per-rank state (data loaders, RNG) last: nothing after it may draw random numbers.

``LoadPipeline.run`` composes them. Where a candidate (a tier's copy, an older tag) is tried, every rank
reports its outcome and all take the same decision (``settle``). The per-process state the steps need
(coordinator, topology, storage, the tier run-time) belongs to the manager and is lent through ``LoadServices``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import adapters, statefile, xla
from nxd_ckpt import rank_state as rank_states
from nxd_ckpt.errors import FormatError, IntegrityError, LayoutMismatchError, RemoteRankError
from nxd_ckpt.format import integrity, layout, tags
from nxd_ckpt.format.describe import TagDescription, describe
from nxd_ckpt.format.metadata import metadata_path
from nxd_ckpt.load import reshard, zero1_io
from nxd_ckpt.load.report import RestoreReport
from nxd_ckpt.log import format_bytes, format_rate
from nxd_ckpt.options import LoadOptions
from nxd_ckpt.ranks import replicas as replica_reads
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryChoice, MemoryTier, Report, choose_memory_tag
from nxd_ckpt.tier.runtime import TierRuntime
from nxd_ckpt.tier.view import TierView
from nxd_ckpt.tree import tensor_bytes

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class LoadServices:
    """What the manager lends a load: its per-process state, as values and callbacks."""

    coordinator: Coordinator
    topology: Callable[[], Topology]
    storage_for: Callable[[Any], Storage]
    tier_runtime: Callable[[MemoryTier, str, Topology], TierRuntime]
    """The memory tier's run-time state for a checkpoint directory (set up collectively on first use)."""
    on_restore: Callable[[RestoreReport], None]
    """Where a load through the memory tier found its checkpoint (the manager's ``last_restore``)."""


@dataclass(frozen=True)
class Outcome:
    """One rank's outcome of loading one candidate: ``verdict`` None (loaded), ``"damaged"`` (a file failed
    verification or is missing: FormatError), or the error's type name."""

    verdict: str | None
    reason: str | None = None
    """What was damaged, as this rank saw it."""
    where: str = ""
    found_here: bool = False
    """This rank found the damage itself (the load's steps raise one rank's damage on every rank)."""

    @staticmethod
    def of(error: BaseException | None, rank: int, where: str = "") -> Outcome:
        if error is None:
            return Outcome(None, None, where)
        if not isinstance(error, FormatError):
            return Outcome(type(error).__name__, None, where)
        origin = getattr(error, "origin_rank", None)  # set when a collective step raised it on every rank
        return Outcome("damaged", str(error), where, origin is None or origin == rank)


def settle(coord: Coordinator, outcome: Outcome, error: BaseException | None, phase: str) -> list[Outcome]:
    """Every rank's outcome of one candidate; raises (this rank's error, else RemoteRankError) unless each rank
    either loaded it or found it damaged. The caller moves on to the next candidate if any is damaged."""
    outcomes = coord.all_gather_object(outcome, phase=phase)
    if all(o.verdict is None for o in outcomes):
        return outcomes
    damaged = [o for o in outcomes if o.verdict == "damaged"]
    if not damaged or any(o.verdict not in (None, "damaged", "RemoteRankError") for o in outcomes):
        if error is not None:
            raise error
        raise RemoteRankError(f"{phase}: failed on another rank: {[o.verdict for o in outcomes]}")
    return outcomes


def damage_reason(outcomes: list[Outcome]) -> str:
    """The damage the ranks found, as the rank that found it described it."""
    reasons = [o.reason for o in outcomes if o.found_here and o.reason] + [o.reason for o in outcomes if o.reason]
    return reasons[0] if reasons else "a file failed verification on another rank"


class LoadPipeline:
    """The steps of one load on one rank, over the services the manager lends."""

    def __init__(self, services: LoadServices) -> None:
        self.services = services
        self.coord = services.coordinator

    def run(self, options: LoadOptions) -> Any:
        """Load ``options`` on this rank (every rank calls it); returns the saved user content."""
        if options.memory_tier is not None:
            return self.from_tiers(options, options.memory_tier)
        return self.from_directory(options.checkpoint_dir, options)

    def from_directory(self, source: Any, options: LoadOptions, topo: Topology | None = None) -> Any:
        """A load from one checkpoint directory (or one memory-tier view, a Storage); ``topo``: the layout when
        the caller has already agreed on it."""
        if options.fallback_to_verified and options.tag is None:
            return self.newest_verified(source, options)
        with self.coord.deadline(options.timeout_s):
            return self.load_tag(source, options.tag, options, topo)

    # ------------------------------------------------------------------ one tag
    def load_tag(self, source: Any, tag: str | None, options: LoadOptions, topo: Topology | None = None) -> Any:
        """resolve → describe → choose → read → restore, for one tag of one directory."""
        coord = self.coord
        call_start = time.perf_counter()
        device = xla.resolve_device(options.device)  # before any collective: a missing torch_xla fails fast
        if topo is None:
            topo = coord.run_all(self.services.topology, "reading the parallel layout")
        storage = source if isinstance(source, TierView) else self.services.storage_for(source)
        targets = options.model is not None or options.optimizer is not None
        resolved, info, share = self.resolve(storage, tag, options.verify, topo, targets)
        if share is not None:  # every file read below is checked against the manifests written with it
            storage = integrity.VerifyingStorage(storage, resolved, share)
        read = self.choose(storage, resolved, info, topo, options)
        start = time.perf_counter()
        result = coord.in_waves(
            options.num_workers, topo.local_rank, topo.local_world_size, lambda: read.apply(device),
            f"loading {resolved!r}",
        )  # fmt: skip
        if not options.skip_rank_state:  # data loaders and RNG last: nothing after them may draw random numbers
            rank_states.restore(coord, storage, resolved, topo, options.rank_state, trusted=options.allow_pickle)
        if coord.rank == 0:  # one line per load, on the master: bytes, time, throughput, time training waited
            elapsed, nbytes = time.perf_counter() - start, loaded_bytes(options.model, options.optimizer)
            logger.info("loaded %s from %s: %s on this rank in %.2f s (%s), training blocked %.2f s", resolved,
                        storage.url, format_bytes(nbytes), elapsed, format_rate(nbytes, elapsed),
                        time.perf_counter() - call_start)  # fmt: skip
        return result

    def resolve(
        self, storage: Storage, tag: str | None, verify: bool, topo: Topology, targets: bool = True
    ) -> tuple[str, TagDescription, integrity.IndexShare | None]:
        """Rank 0 finds the tag to load and describes it, and with ``verify`` reads and merges every manifest,
        once; one step tells every rank the tag and its description (small: it does not grow with the world) and
        hands each rank its share of the manifests (``split_index``): the records of the files it may read
        (``files_read``), not the whole index, which has a record per file of the tag (sent to every rank, it
        cost O(world) bytes per rank, O(world²) in all). A load at another TP/PP size (``targets``: a model or
        optimizer to re-shard) reads parts of many ranks' files (``load.reshard``): there every rank receives
        the whole index, with the description."""
        coord = self.coord

        def resolve() -> tuple[tuple[str, TagDescription, integrity.IndexShare | None], list[Any] | None]:
            tags.recover_resaves(storage, finish_only=True)  # a crash mid-swap: the complete copy gets its name
            resolved = tags.resolve_tag(storage, tag)
            info = describe(storage, resolved)
            if not verify:
                return (resolved, info, None), None
            index = integrity.read_index(storage, resolved)
            if not index or (targets and changes_layout(info, topo)):
                return (resolved, info, integrity.IndexShare(index)), None
            wanted = [
                [path[len(resolved) + 1 :] for path in files_read(resolved, info, topo, rank)]
                for rank in range(coord.world_size)
            ]
            return (resolved, info, None), list(integrity.split_index(index, wanted))

        what = " and reading its manifests" if verify else ""
        (resolved, info, whole), share = coord.master_computes_and_scatters(
            resolve, f"resolving the checkpoint to load from {storage.url}{what}"
        )
        return resolved, info, whole if whole is not None else share

    def choose(self, storage: Storage, tag: str, info: TagDescription, topo: Topology, options: LoadOptions) -> TagRead:
        """The read plan: re-sharded when the TP/PP size changed, else this rank's own files (DP replicas
        reading the same xser file share the reads, when all replicas load in one wave: their groups are made
        only then, as plain files are read by each rank alone)."""
        targets = options.model is not None or options.optimizer is not None
        resharded = None
        if check_layout(info, topo, storage.url, tag) and targets:
            resharded = self.plan_reshard(storage, tag, info, topo, options)
        replicas = None
        if targets and info.xser and options.num_workers >= topo.local_world_size:
            replicas = replica_reads.replica_groups(self.coord, topo)
        return TagRead(storage, tag, info, topo, options, replicas, resharded)

    def plan_reshard(
        self, storage: Storage, tag: str, info: TagDescription, topo: Topology, options: LoadOptions
    ) -> reshard.ReshardedLoad:
        """Every rank's plan of a load at another TP/PP size, checked on all ranks before anything is read."""
        saved = info.metadata.sharding if info.metadata is not None else None
        if saved is None and options.sharding is None:
            raise LayoutMismatchError(
                f"checkpoint {storage.url}/{tag} was saved with TP={info.tp} PP={info.pp} but this job runs "
                f"{topo.describe()}, and it records no sharding (written by NxD, an older nxd_ckpt, or from a "
                "dict): pass sharding= to load_checkpoint (name patterns -> partition dim, or a model whose "
                "parameters carry NxD's attributes) to re-shard it, or load it with the same TP and PP sizes "
                "(DP may differ)"
            )
        trusted = options.allow_pickle

        def plan() -> reshard.ReshardedLoad:
            record = reshard.source_record(storage, tag, info, saved, options.sharding, trusted=trusted)
            return reshard.ReshardedLoad(
                storage, tag, info, record, topo, options.model, options.optimizer, strict=options.strict,
                trusted=trusted,
            )  # fmt: skip

        return self.coord.run_all(plan, f"planning the load of {tag!r} at another parallel layout")

    # ------------------------------------------------------------------ candidates
    def newest_verified(self, source: Any, options: LoadOptions) -> Any:
        """Auto-latest load that skips, newest first, complete tags failing verification (logged as WARNING).

        A tag is skipped when any rank found one of its files damaged or missing (FormatError, which includes
        IntegrityError); every other error is raised. All ranks agree on each attempt's outcome."""
        options = options.replace(verify=True, fallback_to_verified=False)  # one verified load per candidate
        coord, storage = self.coord, self.services.storage_for(source)

        def newest_first() -> list[str]:
            tags.recover_resaves(storage, finish_only=True)
            return [t.name for t in reversed(tags.list_tags(storage))]

        with coord.deadline(options.timeout_s):
            candidates = coord.master_computes(newest_first, f"listing the checkpoints in {storage.url}")
        if not candidates:
            tags.resolve_tag(storage, None)  # raises CheckpointNotFoundError, naming incomplete tags
        failures: list[str] = []
        for candidate in candidates:
            result, error = self.attempt(lambda c=candidate: self.from_directory(source, options.replace(tag=c)))
            with coord.deadline(options.timeout_s):
                outcomes = settle(coord, Outcome.of(error, coord.rank), error, f"agreeing whether {candidate!r} loaded")
            if error is None and all(o.verdict is None for o in outcomes):
                if failures and coord.rank == 0:
                    logger.warning("loaded %s from %s after skipping damaged checkpoints", candidate, storage.url)
                return result
            failures.append(f"{candidate}: {damage_reason(outcomes)}")
            if coord.rank == 0:
                reason = damage_reason(outcomes)
                logger.warning(
                    "CHECKPOINT %s IN %s FAILED VERIFICATION AND IS SKIPPED: %s; falling back to the previous "
                    "complete checkpoint",
                    candidate,
                    storage.url,
                    reason,
                )
        raise IntegrityError(f"no complete checkpoint in {storage.url} passes verification: " + " | ".join(failures))

    @staticmethod
    def attempt(load: Callable[[], Any]) -> tuple[Any, Exception | None]:
        """Run one candidate's load; its result, or the error that stopped it."""
        try:
            return load(), None
        except Exception as e:
            return None, e

    # ------------------------------------------------------------------ memory tier
    def from_tiers(self, options: LoadOptions, tier: MemoryTier) -> Any:
        """The newest complete checkpoint across tiers (or ``options.tag``): this node's memory, else copies
        fetched from other nodes, else the checkpoint directory. Every rank takes the same decision; a copy that
        fails verification anywhere sends every rank to the next tier. ``on_restore`` hears where each rank's
        state came from (logged on rank 0)."""
        coord, storage = self.coord, self.services.storage_for(options.checkpoint_dir)
        with coord.deadline(options.timeout_s):
            topo = coord.run_all(self.services.topology, "reading the parallel layout")
            runtime = self.services.tier_runtime(tier, storage.url, topo)
            reports, durable = coord.gather_and_master_computes(
                runtime.report(),
                lambda: None if options.tag is not None else newest_durable(storage),
                f"memory tier: what each node holds; listing the checkpoints in {storage.url}",
            )
            choice = choose_memory_tag(reports, options.tag)
        failures: list[str] = []
        if choice is not None and (durable is None or choice.created_at >= durable[1] or durable[0] == choice.tag):
            # a tier copy counts only verified: every file read is checked against its manifest
            verified = options.replace(fallback_to_verified=False, verify=True)
            restored = self.from_tier_copies(runtime, choice, reports, verified, failures, topo)
            if restored is not None:
                return restored[0]
        elif choice is None and coord.rank == 0:
            logger.info("no complete checkpoint%s in the memory tier; loading from %s",
                        f" {options.tag!r}" if options.tag else "", storage.url)  # fmt: skip
        result = self.from_directory(options.checkpoint_dir, options, topo)
        restore = RestoreReport(options.tag or tags.latest_tag(storage) or "", ["durable"] * coord.world_size)
        self.services.on_restore(restore)
        if coord.rank == 0:
            logger.info("restored %s from %s (durable)%s", restore.tag, storage.url,
                        " after: " + " | ".join(failures) if failures else "")  # fmt: skip
        return result

    def from_tier_copies(
        self, runtime: TierRuntime, choice: MemoryChoice, reports: list[Report], options: LoadOptions,
        failures: list[str], topo: Topology,
    ) -> tuple[Any] | None:  # fmt: skip
        """This node's copy, then (ranks that found damage) other nodes' copies; ``(result,)`` once every rank
        loaded, None (with ``failures`` told why) when the durable directory must serve."""
        coord = self.coord
        view: TierView | None = runtime.view(choice, reports, prefer_remote=False)
        damaged = False
        for attempt in ("local", "peer"):
            if attempt == "peer":
                # Ranks that found damage read every share from another node's copy; the others keep theirs.
                if damaged:
                    view = runtime.view(choice, reports, prefer_remote=True)
                with coord.deadline(options.timeout_s):
                    ready = coord.all_gather_object(view is not None, phase="memory tier: other copies")
                if not all(ready):
                    return None
            assert view is not None
            result, error = self.attempt(lambda v=view: self.from_directory(v, options.replace(tag=choice.tag), topo))
            outcome = Outcome.of(error, coord.rank, "peer" if view.bytes_remote else "memory")
            damaged = outcome.found_here
            with coord.deadline(options.timeout_s):
                outcomes = settle(coord, outcome, error, f"memory tier: agreeing whether {choice.tag!r} loaded")
            if error is None and all(o.verdict is None for o in outcomes):
                restore = RestoreReport(choice.tag, [o.where for o in outcomes])
                self.services.on_restore(restore)
                if coord.rank == 0:
                    logger.info("restored %s from the memory tier (%s)", choice.tag, restore.summary())
                return (result,)
            failures.append(f"{attempt} copy: {damage_reason(outcomes)}")
            if coord.rank == 0:
                logger.warning("the %s copy of checkpoint %s in the memory tier failed verification (%s); trying "
                               "the next tier", attempt, choice.tag, damage_reason(outcomes))  # fmt: skip
        return None


@dataclass(frozen=True)
class TagRead:
    """The read plan of one resolved tag on this rank: which files (or re-sharded parts) fill which target."""

    storage: Storage
    tag: str
    info: TagDescription
    topo: Topology
    options: LoadOptions
    replicas: replica_reads.ReplicaGroup | None
    resharded: reshard.ReshardedLoad | None

    def apply(self, device: torch.device | None) -> Any:
        """Read and load model, optimizer and scheduler into their targets; return the saved user content."""
        o = self.options
        optimizer_read = self._optimizer_read_ahead(device)
        try:
            if o.model is not None:
                state, source = self.model_state()
                adapters.load_model_state(o.model, state, strict=o.strict, source=source, device=device)
        except BaseException:
            if optimizer_read is not None:  # no thread is left writing into the optimizer's tensors
                concurrent.futures.wait([optimizer_read])
            raise
        if o.optimizer is not None:
            state, source = optimizer_read.result() if optimizer_read is not None else self.optimizer_state()
            adapters.load_optimizer_state(o.optimizer, state, source=source, device=device)
        if o.scheduler is not None:
            path = layout.tag_path(self.tag, layout.SCHEDULER_FILE)
            state = self.read(path)
            adapters.load_scheduler_state(o.scheduler, state, source=f"{self.storage.url}/{path}", device=device)
        path = layout.tag_path(self.tag, layout.USER_CONTENT_FILE)
        if self.storage.exists(path):
            return statefile.read_plain(self.storage, path, trusted=o.allow_pickle)
        return None

    def _optimizer_read_ahead(self, device: torch.device | None) -> concurrent.futures.Future | None:
        """The optimizer's files read on a thread of their own while the model's are read, so the storage stays
        busy while the model's bytes are copied (2 ranks, xser into the live module: 1.24 s -> 1.17 s, medians
        of 6). Only where that read needs no collective (a ZeRO-1 shard, or no DP replicas sharing reads: two
        threads must not run collectives at once) and everything lands in host memory (a load onto a device
        stages through one set of host buffers at a time)."""
        o = self.options
        if o.model is None or o.optimizer is None or self.resharded is not None:
            return None
        if not (self.info.zero1 or self.replicas is None) or (device is not None and device.type != "cpu"):
            return None
        if adapters.holds_device_tensors(o.model, "model") or adapters.holds_device_tensors(o.optimizer, "optimizer"):
            return None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nxd_ckpt_optimizer_read")
        try:
            return pool.submit(self.optimizer_state)
        finally:
            pool.shutdown(wait=False)

    def model_state(self) -> tuple[Any, str]:
        """The model's state and where it came from: straight into the live model's tensors (no second copy),
        checked against it first; or assembled from the parts it covers at another layout."""
        if self.resharded is not None:
            return self.resharded.model_state(), f"{self.storage.url}/{self.tag}"
        topo, o = self.topo, self.options
        path = model_path(self.tag, topo, topo.rank)
        source = f"{self.storage.url}/{path}"
        target = adapters.load_target(o.model, "model", strict=o.strict, source=source)
        return self.read(path, self.replicas, target), source

    def optimizer_state(self) -> tuple[Any, str]:
        """The optimizer's state: re-sharded, this rank's ZeRO-1 shard (re-cut when the DP size changed), or the
        replicated state of its (TP, PP) coordinate."""
        if self.resharded is not None:
            return self.resharded.optimizer_state(), f"{self.storage.url}/{self.tag}"
        info, topo, o = self.info, self.topo, self.options
        path = optimizer_path(self.tag, info, topo, topo.rank)
        source = f"{self.storage.url}/{path}"
        recut, saved_dp = zero1_io.reshard_source(info, topo)
        if recut and topo.expert_parallel:
            raise LayoutMismatchError(
                f"checkpoint {self.storage.url}/{self.tag} holds ZeRO-1 state for {saved_dp or 'full'} shards but "
                f"this job runs {topo.describe()}: re-sharding ZeRO-1 state under expert parallelism (expert "
                "parameters shard over expert-data-parallel groups) is not supported; use the saved DP size"
            )
        if recut:  # ZeRO-1 saved with another DP size (or full): read only the rows this shard covers
            return zero1_io.load_resharded_state(self.storage, self.tag, saved_dp, topo, trusted=o.allow_pickle), source
        target = adapters.load_target(o.optimizer, "optimizer")
        return self.read(path, None if info.zero1 else self.replicas, target), source

    def read(
        self, path: str, replicas: replica_reads.ReplicaGroup | None = None, target: statefile.LoadTarget | None = None
    ) -> Any:
        """One state file of the tag (into ``target``'s tensors when given); a missing one is a FormatError
        that says why (never written, or ZeRO-1 state in DCP format)."""
        storage = self.storage
        if not storage.exists(path):
            raise missing_file_error(storage, path)
        state = statefile.read_state_file(
            storage, path, trusted=self.options.allow_pickle, group=replicas, target=target
        )
        return target.finish(state) if target is not None else state


def model_path(tag: str, topo: Topology, rank: int) -> str:
    """The model file ``rank`` reads at the saved TP/PP layout: its (TP, PP[, EP]) coordinate's."""
    c = topo.coordinates(rank)
    return layout.model_file(tag, c.tp, c.pp, topo.file_ep_rank_of(rank))


def optimizer_path(tag: str, info: TagDescription, topo: Topology, rank: int) -> str:
    """The optimizer file of ``rank`` at the saved TP/PP layout: its ZeRO-1 shard, or the replicated state of
    its (TP, PP[, EP]) coordinate."""
    c = topo.coordinates(rank)
    if info.zero1:
        return layout.optim_file(tag, topo.zero1_rank_of(rank), c.tp, c.pp)
    return layout.optim_file(tag, 0, c.tp, c.pp, topo.file_ep_rank_of(rank))


def files_read(tag: str, info: TagDescription, topo: Topology, rank: int) -> list[str]:
    """Every file ``rank`` may read in a load of ``tag`` at the saved TP/PP layout (``TagRead``); the master
    works these out for every rank to hand each its share of the manifests (``LoadPipeline.resolve``). Each
    path stands for its xser parts too (``layout.state_file_of``).

    The model file; the optimizer file, or with ZeRO-1 at another DP size (or merged full files) every ZeRO-1
    file of its (TP, PP) coordinate (``zero1_io.source_paths``: a superset of those holding its rows, which
    depend on each tensor's length); scheduler, user content, metadata; its per-rank state
    (``rank_state.files_read``); with expert parallelism the ``ep_rank_00`` files, whose folders hold the
    non-expert tensors of xser files (``layout.shared_tensors_file``). DP replicas sharing the reads of an xser
    file (``dist.replicas``) read parts of their own model file: covered."""
    c = topo.coordinates(rank)
    recut, saved_dp = zero1_io.reshard_source(info, topo)
    optim = zero1_io.source_paths(tag, c.tp, c.pp, saved_dp) if recut else [optimizer_path(tag, info, topo, rank)]
    files = [
        model_path(tag, topo, rank),
        *optim,
        layout.tag_path(tag, layout.SCHEDULER_FILE),
        layout.tag_path(tag, layout.USER_CONTENT_FILE),
        metadata_path(tag),
        *rank_states.files_read(tag, rank),
    ]
    return list(dict.fromkeys(files + [layout.shared_tensors_file(path) for path in files]))


def changes_layout(info: TagDescription, topo: Topology) -> bool:
    """Whether a load of ``info`` at ``topo`` is re-sharded (``check_layout``); False for a layout it refuses
    (every rank raises that in ``LoadPipeline.choose``)."""
    try:
        return check_layout(info, topo, "", info.tag)
    except LayoutMismatchError:
        return False


def missing_file_error(storage: Storage, path: str) -> FormatError:
    """Why a tag lacks ``path``: ZeRO-1 state written as DCP (NxD's ``use_zero1_dcp``), or damage."""
    tag_dir, _, rest = path.partition("/")
    if rest.startswith(layout.OPTIM_DIR + "/") and storage.exists(
        layout.tag_path(tag_dir, layout.OPTIM_DIR, layout.DCP_METADATA_FILE)
    ):
        return FormatError(
            f"{storage.url}/{tag_dir}/{layout.OPTIM_DIR} holds ZeRO-1 state in torch Distributed Checkpoint format "
            "(NxD's use_zero1_dcp=True), which nxd_ckpt does not read; load the model without the optimizer, or "
            "re-save the optimizer state with use_zero1_dcp=False"
        )
    return FormatError(
        f"checkpoint file {storage.url}/{path} is missing; the checkpoint is damaged or was saved "
        "without this state (load without it, or pick another tag)"
    )


def newest_durable(storage: Storage) -> tuple[str, float] | None:
    """Rank 0: the newest complete tag in the checkpoint directory and its time, or None."""
    tags.recover_resaves(storage, finish_only=True)
    listed = tags.list_tags(storage)
    return (listed[-1].name, listed[-1].order_time) if listed else None


def check_layout(info: TagDescription, topo: Topology, url: str, tag: str) -> bool:
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


def loaded_bytes(*targets: Any) -> int:
    """Tensor bytes now held by the load targets (modules/optimizers via state_dict, dicts as they are)."""
    return sum(tensor_bytes(t.state_dict() if hasattr(t, "state_dict") else t) for t in targets if t is not None)
