"""Which tag a load reads, agreed on by every rank: the named one or the latest complete one (``resolve``);
around a whole load, the memory tier's copies (``TierLoad``: this node, then peers, then the checkpoint
directory) or, with ``fallback_to_verified``, the newest tag that passes verification everywhere
(``NewestVerified``).

These decide which candidate comes next; the load's pipeline loads each (``attempts``) and reports how it went
(their ``settle``): no call goes back from here into the pipeline. Where a candidate (a tier's copy, an older
tag) is tried, every rank reports its ``Outcome`` and all take the same decision (``settle``): each rank loaded
it, or some rank found it damaged and all move on to the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nxd_ckpt.errors import FormatError, IntegrityError, RemoteRankError
from nxd_ckpt.format import integrity, resave, tags
from nxd_ckpt.format.describe import TagDescription, describe
from nxd_ckpt.load.read_plan import changes_layout, files_read
from nxd_ckpt.load.report import RestoreReport
from nxd_ckpt.options import LoadOptions
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryChoice, Report, choose_memory_tag
from nxd_ckpt.tier.runtime import TierRuntime
from nxd_ckpt.tier.view import TierView

logger = logging.getLogger("nxd_ckpt")


def resolve(
    coord: Coordinator, storage: Storage, tag: str | None, verify: bool, topo: Topology, targets: bool = True
) -> tuple[str, TagDescription, integrity.IndexShare | None]:
    """Rank 0 finds the tag to load (``tag``, else the latest complete one) and describes it, and with ``verify``
    reads and merges every manifest, once; one step tells every rank the tag and its description (small: it does
    not grow with the world) and hands each rank its share of the manifests (``split_index``): the records of the
    files it may read (``files_read``), not the whole index, which has a record per file of the tag (sent to
    every rank, it cost O(world) bytes per rank, O(world²) in all). A load at another TP/PP size (``targets``: a
    model or optimizer to re-shard) reads parts of many ranks' files (``load.reshard``): there every rank
    receives the whole index, with the description."""

    def resolve() -> tuple[tuple[str, TagDescription, integrity.IndexShare | None], list[Any] | None]:
        resave.recover_resaves(storage, finish_only=True)  # a crash mid-swap: the complete copy gets its name
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


# ----------------------------------------------------------------------------------------------- agreeing
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
        """The outcome of ``error`` (None: loaded) on ``rank``; ``where`` the state came from."""
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


# ----------------------------------------------------------------------------------------------- fallback
class NewestVerified:
    """An auto-latest load that skips, newest first, complete tags failing verification (logged as WARNING).

    The load's pipeline tries each of ``attempts()`` (the options of one candidate tag, verified) and tells
    ``settle`` how it went; a tag is skipped when any rank found one of its files damaged or missing
    (FormatError, which includes IntegrityError); every other error is raised. All ranks agree on each
    attempt's outcome. Past the last candidate, ``attempts`` raises IntegrityError naming every failure."""

    def __init__(self, coord: Coordinator, storage: Storage, options: LoadOptions) -> None:
        self.coord = coord
        self.storage = storage
        self.options = options.replace(verify=True, fallback_to_verified=False)  # one verified load per candidate
        self.failures: list[str] = []

    def attempts(self) -> Iterator[LoadOptions]:
        """The options of each candidate, newest first (listed by rank 0, told to all)."""
        coord, storage = self.coord, self.storage

        def newest_first() -> list[str]:
            resave.recover_resaves(storage, finish_only=True)
            return [t.name for t in reversed(tags.list_tags(storage))]

        with coord.deadline(self.options.timeout_s):
            names = coord.master_computes(newest_first, f"listing the checkpoints in {storage.url}")
        if not names:
            tags.resolve_tag(storage, None)  # raises CheckpointNotFoundError, naming incomplete tags
        for name in names:
            yield self.options.replace(tag=name)
        raise IntegrityError(
            f"no complete checkpoint in {storage.url} passes verification: " + " | ".join(self.failures)
        )

    def settle(self, tagged: LoadOptions, error: Exception | None) -> bool:
        """Every rank's outcome of loading ``tagged.tag``: True once every rank loaded it; False (logged, recorded)
        when some rank found it damaged; raises any other failure, on every rank."""
        coord, candidate = self.coord, tagged.tag
        with coord.deadline(self.options.timeout_s):
            outcomes = settle(coord, Outcome.of(error, coord.rank), error, f"agreeing whether {candidate!r} loaded")
        if error is None and all(o.verdict is None for o in outcomes):
            if self.failures and coord.rank == 0:
                logger.warning("loaded %s from %s after skipping damaged checkpoints", candidate, self.storage.url)
            return True
        reason = damage_reason(outcomes)
        self.failures.append(f"{candidate}: {reason}")
        if coord.rank == 0:
            logger.warning(
                "CHECKPOINT %s IN %s FAILED VERIFICATION AND IS SKIPPED: %s; falling back to the previous "
                "complete checkpoint",
                candidate,
                self.storage.url,
                reason,
            )
        return False


# ----------------------------------------------------------------------------------------------- memory tier
def newest_durable(storage: Storage) -> tuple[str, float] | None:
    """Rank 0: the newest complete tag in the checkpoint directory and its time, or None."""
    resave.recover_resaves(storage, finish_only=True)
    listed = tags.list_tags(storage)
    return (listed[-1].name, listed[-1].order_time) if listed else None


@dataclass(frozen=True)
class Attempt:
    """One source a load through the memory tier tries: this node's copy, other nodes' copies, or the checkpoint
    directory (``step``: "local", "peer" or "durable")."""

    source: Any
    """A ``TierView`` (a Storage) of a tier's copy, or the checkpoint directory."""
    options: LoadOptions
    step: str

    @property
    def where(self) -> str:
        """Where this rank's state came from ("memory", "peer", "durable"), for the ``RestoreReport``: known once
        the load read it (a tier view counts the bytes it fetched from other nodes)."""
        if self.step == "durable":
            return "durable"
        return "peer" if self.source.bytes_remote else "memory"


class TierLoad:
    """A load through the memory tier, on one rank: this node's memory, else copies fetched from other nodes,
    else the checkpoint directory (``storage``). The load's pipeline tries each of ``attempts`` and tells
    ``settle`` how it went; once one is settled, ``restore`` says where every rank's state came from."""

    def __init__(self, coord: Coordinator, storage: Storage, topo: Topology, runtime: TierRuntime) -> None:
        self.coord = coord
        self.storage = storage
        self.topo = topo
        self.runtime = runtime
        """The memory tier's run-time state for ``storage`` (set up by every rank before)."""
        self.restore: RestoreReport | None = None
        self.failures: list[str] = []
        self._damaged = False

    def attempts(self, options: LoadOptions) -> Iterator[Attempt]:
        """The newest complete checkpoint across tiers (or ``options.tag``): the tier's copies when they are as
        new as the directory's, then the directory. Every rank takes the same decision; a copy that fails
        verification anywhere sends every rank to the next tier (logged on rank 0)."""
        coord, storage = self.coord, self.storage
        with coord.deadline(options.timeout_s):
            reports, durable = coord.gather_and_master_computes(
                self.runtime.report(),
                lambda: None if options.tag is not None else newest_durable(storage),
                f"memory tier: what each node holds; listing the checkpoints in {storage.url}",
            )
            choice = choose_memory_tag(reports, options.tag)
        if choice is not None and (durable is None or choice.created_at >= durable[1] or durable[0] == choice.tag):
            # a tier copy counts only verified: every file read is checked against its manifest
            verified = options.replace(fallback_to_verified=False, verify=True, tag=choice.tag)
            yield from self.copies(choice, reports, verified)
            if self.restore is not None:
                return
        elif choice is None and coord.rank == 0:
            logger.info("no complete checkpoint%s in the memory tier; loading from %s",
                        f" {options.tag!r}" if options.tag else "", storage.url)  # fmt: skip
        yield Attempt(options.checkpoint_dir, options, "durable")

    def copies(self, choice: MemoryChoice, reports: list[Report], options: LoadOptions) -> Iterator[Attempt]:
        """This node's copy, then (ranks that found damage) other nodes' copies; none once every rank loaded one,
        or once some rank has no other copy (the durable directory must serve)."""
        coord, runtime = self.coord, self.runtime
        view: TierView | None = runtime.view(choice, reports, prefer_remote=False)
        for step in ("local", "peer"):
            if step == "peer":
                # Ranks that found damage read every share from another node's copy; the others keep theirs.
                if self._damaged:
                    view = runtime.view(choice, reports, prefer_remote=True)
                with coord.deadline(options.timeout_s):
                    ready = coord.all_gather_object(view is not None, phase="memory tier: other copies")
                if not all(ready):
                    return
            assert view is not None
            yield Attempt(view, options, step)
            if self.restore is not None:
                return

    def settle(self, attempt: Attempt, error: Exception | None) -> bool:
        """Every rank's outcome of ``attempt``: True once every rank loaded it (``restore`` says from where);
        False (logged) when a tier's copy was damaged somewhere; raises any other failure, and the checkpoint
        directory's."""
        coord = self.coord
        if attempt.step == "durable":
            if error is not None:
                raise error
            tag = attempt.options.tag or tags.latest_tag(self.storage) or ""
            self.restore = RestoreReport(tag, ["durable"] * coord.world_size)
            if coord.rank == 0:
                logger.info("restored %s from %s (durable)%s", tag, self.storage.url,
                            " after: " + " | ".join(self.failures) if self.failures else "")  # fmt: skip
            return True
        tag = attempt.options.tag
        outcome = Outcome.of(error, coord.rank, attempt.where)
        self._damaged = outcome.found_here
        with coord.deadline(attempt.options.timeout_s):
            outcomes = settle(coord, outcome, error, f"memory tier: agreeing whether {tag!r} loaded")
        if error is None and all(o.verdict is None for o in outcomes):
            self.restore = RestoreReport(tag or "", [o.where for o in outcomes])
            if coord.rank == 0:
                logger.info("restored %s from the memory tier (%s)", tag, self.restore.summary())
            return True
        self.failures.append(f"{attempt.step} copy: {damage_reason(outcomes)}")
        if coord.rank == 0:
            logger.warning("the %s copy of checkpoint %s in the memory tier failed verification (%s); trying "
                           "the next tier", attempt.step, tag, damage_reason(outcomes))  # fmt: skip
        return False
