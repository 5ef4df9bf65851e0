"""The steps of one load, composed: ``LoadPipeline.run`` calls them in this order, on every rank.

  0. candidates  around a whole load, which tag is tried (``load.candidates``): the memory tier (``TierLoad``:
                 this node's copy, then peers', then the checkpoint directory) or ``fallback_to_verified``
                 (``newest_verified``: newest first, skipping tags that fail verification anywhere); every rank
                 reports each candidate's outcome and all take the same decision (``settle``). Each candidate is
                 one load of steps 1 to 5:
  1. resolve     rank 0 finds the tag (the latest complete one by default; a re-save a crash interrupted is
                 finished first) and describes it (``format.describe``); with ``verify`` each rank receives the
                 records of its own files from the manifests, and every file read below is checked against them
                 (``candidates.resolve``);
  2. plan        ``read_plan.plan_read``, a pure function: which files this rank reads into which target (its own
                 files at the same TP/PP layout, or re-sharded at another one), and whether DP replicas share
                 the reads;
  3. prepare     what the plan needs from the other ranks, before anything is read: a re-sharded load's parts
                 (``read.prepare_reshard``), the DP replica groups sharing reads (``ranks.replicas``);
  4. read        ``read.PlanRead.apply``: model, optimizer, scheduler and user content, in waves of
                 ``num_workers`` ranks per host;
  5. restore     per-rank state (data loaders, RNG) last: nothing after it may draw random numbers.

After the load, on each rank, no collective:
  6. report      a resume of a tag saved with ``async_save=True`` into its model and optimizer is reported
                 (``LoadPipeline.resumed``: an ``AsyncResume``); the manager then prepares the next async save
                 (``prepare_async_save`` of them, ``use_xser`` as the tag was saved), so the first async save
                 after the resume blocks like the later ones. The load itself calls nothing of the save's.

The per-process state the steps need (coordinator, topology, storage, the tier run-time) belongs to the manager
and is lent through ``LoadServices``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nxd_ckpt import resume_state as rank_states
from nxd_ckpt import xla
from nxd_ckpt.format import integrity
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.load import candidates
from nxd_ckpt.load.read import PlanRead, loaded_bytes, prepare_reshard
from nxd_ckpt.load.read_plan import plan_read
from nxd_ckpt.load.report import RestoreReport
from nxd_ckpt.log import format_bytes, format_rate
from nxd_ckpt.options import LoadOptions
from nxd_ckpt.ranks import replicas as replica_reads
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.runtime import TierRuntime
from nxd_ckpt.tier.view import TierView

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
class AsyncResume:
    """Step 6: a load resumed a tag saved with ``async_save=True`` into the model and optimizer it holds, so the
    next async save of them can be prepared (by the manager)."""

    tag: str
    use_xser: bool
    """As the tag was saved: with DP replicas a rank snapshots only its share of the files, which depends on it."""


class LoadPipeline:
    """The steps of one load on one rank, over the services the manager lends."""

    def __init__(self, services: LoadServices) -> None:
        self.services = services
        self.coord = services.coordinator
        self.loaded: TagDescription | None = None
        """The description of the tag the last successful ``load_tag`` read (the one step 6 looks at)."""
        self.resumed: AsyncResume | None = None
        """Set by ``run`` when the load resumed an async-saved tag into its model and optimizer (step 6)."""

    def run(self, options: LoadOptions) -> Any:
        """Load ``options`` on this rank (every rank calls it); returns the saved user content."""
        if options.memory_tier is not None:
            result = self.from_tiers(options, options.memory_tier)
        else:
            result = self.from_directory(options.checkpoint_dir, options)
        self.resumed = self.async_resume(options)
        return result

    def from_tiers(self, options: LoadOptions, tier: MemoryTier) -> Any:
        """Step 0, memory tier: every rank agrees on the layout and sets up the tier, then tries the tier's
        copies before the checkpoint directory, in the order ``candidates.TierLoad`` gives them."""
        coord, storage = self.coord, self.services.storage_for(options.checkpoint_dir)
        with coord.deadline(options.timeout_s):
            topo = coord.run_all(self.services.topology, "reading the parallel layout")
            runtime = self.services.tier_runtime(tier, storage.url, topo)
        tier_load = candidates.TierLoad(coord, storage, topo, runtime)
        for attempt in tier_load.attempts(options):
            result, error = self.attempt(attempt.source, attempt.options, topo)
            if tier_load.settle(attempt, error):
                assert tier_load.restore is not None
                self.services.on_restore(tier_load.restore)
                return result
        raise AssertionError("unreachable: the checkpoint directory, tried last, settles or raises")

    def from_directory(self, source: Any, options: LoadOptions, topo: Topology | None = None) -> Any:
        """A load from one checkpoint directory (or one memory-tier view, a Storage); ``topo``: the layout when
        the caller has already agreed on it. Step 0 with ``fallback_to_verified``: the newest verified tag, in the
        order ``candidates.NewestVerified`` gives them."""
        if options.fallback_to_verified and options.tag is None:
            fallback = candidates.NewestVerified(self.coord, self.services.storage_for(source), options)
            for tagged in fallback.attempts():  # raises once every candidate failed verification
                result, error = self.attempt(source, tagged)
                if fallback.settle(tagged, error):
                    return result
        with self.coord.deadline(options.timeout_s):
            return self.load_tag(source, options.tag, options, topo)

    def attempt(self, source: Any, options: LoadOptions, topo: Topology | None = None) -> tuple[Any, Exception | None]:
        """One candidate's load: its result, or the error that stopped it (for the candidates to settle)."""
        try:
            return self.from_directory(source, options, topo), None
        except Exception as e:
            return None, e

    def load_tag(self, source: Any, tag: str | None, options: LoadOptions, topo: Topology | None = None) -> Any:
        """Steps 1 to 5 (resolve → plan → prepare → read → restore), for one tag of one directory."""
        coord = self.coord
        call_start = time.perf_counter()
        device = xla.resolve_device(options.device)  # before any collective: a missing torch_xla fails fast
        if topo is None:
            topo = coord.run_all(self.services.topology, "reading the parallel layout")
        storage = source if isinstance(source, TierView) else self.services.storage_for(source)
        targets = options.model is not None or options.optimizer is not None
        resolved, info, share = candidates.resolve(coord, storage, tag, options.verify, topo, targets)
        if share is not None:  # every file read below is checked against the manifests written with it
            storage = integrity.VerifyingStorage(storage, resolved, share)
        plan = plan_read(
            resolved, info, topo, url=storage.url, model=options.model is not None,
            optimizer=options.optimizer is not None, scheduler=options.scheduler is not None,
            num_workers=options.num_workers,
        )  # fmt: skip
        resharded = prepare_reshard(coord, storage, info, topo, options) if plan.resharded else None
        replicas = replica_reads.replica_groups(coord, topo) if plan.share_reads else None
        read = PlanRead(storage, plan, topo, options, replicas, resharded)
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
        self.loaded = info
        return result

    def async_resume(self, options: LoadOptions) -> AsyncResume | None:
        """Step 6: the load resumed a tag saved asynchronously, and restored what the tag holds of the model and
        optimizer (a save of both would not use a preparation of one); else None."""
        meta = self.loaded.metadata if self.loaded is not None else None
        if meta is None or not meta.saved_async:
            return None
        given = (("model", options.model), ("optimizer", options.optimizer))
        restored = {name for name, target in given if target is not None}
        if not restored or restored != {"model", "optimizer"} & set(meta.items):
            return None
        return AsyncResume(meta.tag, bool(meta.xser))
