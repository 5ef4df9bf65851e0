"""``StorageWriter``: DCP's storage writer over the library's storage, checksums and commit.

The files are stock DCP (``__<rank>_<n>.distcp`` of ``torch.save``'d tensors and raw bytes, DCP's ``.metadata``
with ``_StorageInfo`` records), so DCP's own ``FileSystemReader`` reads them. What it adds:

- every file is hashed as it streams out (``integrity.ChecksummingStorage``) and each rank writes its manifest
  ``nxd_ckpt/manifest_rank_RRRRR.json`` (a folder DCP never reads; ``verify`` reads it) after its files and their
  directories are durable, before ``write_data`` returns;
- one commit round: each rank's file records travel to the coordinator's ``finish`` in a ``WriteResult`` of their
  own (``_RankRecords``) through DCP's gather of the write results (every other result keeps DCP's
  ``_StorageInfo``, so stock readers read the checkpoint); the coordinator checks them in memory and writes what a
  load needs in a fixed number of storage requests, whatever the number of ranks: the combined index
  (``nxd_ckpt/dcp_index.json``) and ``.metadata``'s record at a fixed place (``nxd_ckpt/dcp_metadata.json``);
- the commit is the NxD path's (``save.commit`` with ``layout.DCP_COMMIT``): the coordinator's
  ``prepare_global_plan`` settles a killed save and starts the hidden staging folder (``prepare_folder``); its
  ``finish`` writes ``.metadata`` last (tmp + fsync + rename + directory fsync) and swaps the staged folder in
  (``complete_folder``): a save killed at any moment leaves the previous checkpoint in the folder loadable, and
  saving into a folder that holds one replaces it only at the commit;
- a rank's failure anywhere in the save reaches every rank at once through DCP's gather; the coordinator's
  deadline on the ranks' writes runs beside it (``checkin``);
- every storage call runs under the library's deadline (``watchdog``: a stalled call raises instead of hanging);
- with ``memory_tier=`` every save goes to node memory and peer nodes' memory (``tier``), and every
  ``durable_every``-th save also to the folder: each rank's files are written into its node's share and
  replicated, the coordinator's (with ``.metadata``) last, in ``finish``, so a copy counts only once every rank's
  files are there.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from nxd_ckpt.dcp.checkin import WrittenCheckIn, check_recorded
from nxd_ckpt.dcp.place import METADATA, CheckpointPlace, FolderId
from nxd_ckpt.device import kept_budget
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.integrity import ChecksummingStorage
from nxd_ckpt.format.layout import DCP_COMMIT
from nxd_ckpt.format.manifests import FileRecord, index_bytes, manifest_bytes
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.save import commit
from nxd_ckpt.storage import Storage
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.runtime import TierSave
from nxd_ckpt.tier.shared import SharedTier, shared_tier
from nxd_ckpt.watchdog import StorageMonitor, run_watched

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _TierPlan:
    """The coordinator's decisions on a save through the memory tier, the same for every rank: the save's time
    (its copies' identity in the tier) and whether it also goes to the folder (every ``durable_every``-th)."""

    created_at: float
    durable: bool
    world_size: int


@dataclasses.dataclass(frozen=True)
class _RankFiles:
    """What the coordinator's global plan tells one rank's writer: its rank and its files' name prefix, the same
    on every save (DCP's plan caching, ``DefaultSavePlanner(enable_plan_caching=True)``, hands a rank the first
    save's plan again: nothing of one save may live here; that is ``_SaveFacts``)."""

    rank: int
    prefix: str
    world_size: int = 1
    snapshot_budget: tuple[int, int] | None = None
    """(this rank's offer's ticket, the least of the ranks' offers): the device snapshot budget the ranks' stagers
    agreed on in this save's plan gather (``device.kept_budget``), None when no rank offered one."""


@dataclasses.dataclass(frozen=True)
class _SaveFacts:
    """The coordinator's facts of one save, the same on every rank: its id on the store (for ``checkin``) and its
    memory-tier decision. Decided by the coordinator's ``prepare_global_plan``, which runs on every save, cached
    plans or not; the other ranks read them from the store under the folder's key (``_facts_key``) in
    ``write_data``: the coordinator set them before DCP scattered the plans, and cannot set the next save's before
    every rank's ``write_data`` has ended (DCP gathers their results first)."""

    save_key: str
    tier: _TierPlan | None = None

    def to_json(self) -> bytes:
        return json.dumps({"save_key": self.save_key, "tier": None if self.tier is None else list(
            dataclasses.astuple(self.tier))}).encode()  # fmt: skip

    @classmethod
    def from_json(cls, data: bytes) -> _SaveFacts:
        raw = json.loads(data)
        tier = raw["tier"]
        return cls(raw["save_key"], None if tier is None else _TierPlan(float(tier[0]), bool(tier[1]), int(tier[2])))


def _facts_key(place: CheckpointPlace) -> str:
    """The store key of the save in flight into ``place`` (one save into a folder at a time)."""
    return f"nxd_ckpt/dcp/save/{place.root.url}/{place.folder}"


_RECORDS_FQN = "nxd_ckpt.rank_records"
"""The key of each rank's ``_RankRecords`` among the write results (never in ``.metadata``: ``finish`` takes them
out)."""


@dataclasses.dataclass(frozen=True)
class _RankRecords:
    """One rank's file records (opaque ``FileRecord``s, as the manifest layer makes them) and its manifest's bytes
    (the rank's part of the combined index, made on the rank so the coordinator only copies it), carried to the
    coordinator's ``finish`` as the ``storage_data`` of a ``WriteResult`` of its own; None for a save to the memory
    tier only (nothing reaches the folder)."""

    rank: int
    records: dict[str, FileRecord] | None
    manifest: bytes = b""


class StorageWriter(FolderId, _DcpStorageWriter):
    """Writes a DCP checkpoint into the folder ``path`` (a local path; ``s3://`` through the library's storage)
    with per-rank checksums and a crash-safe commit.

    >>> # xdoctest: +SKIP
    >>> dcp.save(state_dict, storage_writer=nxd_ckpt.dcp.StorageWriter("/ckpt/step-100"))

    Args:
        path: the checkpoint folder (``checkpoint_id``); its parent holds the hidden staging directory.
        thread_count: files (and threads) per rank.
        timeout: seconds for each phase's storage calls (default ``NXD_CKPT_TIMEOUT_S``).
        memory_tier: save to node memory and peer nodes (``nxd_ckpt.MemoryTier``), the folder every
            ``durable_every``-th save. Collective the first time in a process (every rank builds its writer at
            the same point: the node's file server starts and the addresses are exchanged).
    """

    _PER_PROCESS = ("place", "tier", "_tier_save")

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int = 1,
        timeout: float | None = None,
        memory_tier: MemoryTier | None = None,
    ) -> None:
        super().__init__()
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")
        self.thread_count = thread_count
        self.timeout_s = resolve_timeout(timeout)
        self.memory_tier = memory_tier
        self.tier: SharedTier | None = None
        self._rank = 0
        self._is_coordinator = False
        self._durable = True
        self._tier_save: TierSave | None = None
        self._facts: _SaveFacts | None = None
        self._check_in: WrittenCheckIn | None = None
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save (into ``checkpoint_id`` when given)."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self.place = CheckpointPlace.of(self.path)
            if self.memory_tier is not None:
                self.tier = shared_tier(self.memory_tier, self.place.root.url, self.timeout_s)
        self.save_id = str(uuid.uuid4())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Refuses rank-local saves (``use_collectives=False``): they have no single commit."""
        self._is_coordinator = is_coordinator
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                "nxd_ckpt.dcp.StorageWriter commits one checkpoint for all ranks; dcp.save(..., "
                "use_collectives=False) writes rank-local metadata without a commit: save with use_collectives=True"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Carries this rank's device snapshot budget offer (``nxd_ckpt.dcp.Stager``'s, if it staged this save) to
        the coordinator in DCP's own plan gather: the ranks agree on it without a round of their own."""
        return dataclasses.replace(plan, storage_data=kept_budget.take_offer())

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator, before any rank writes: settle an interrupted save, empty the staging directory (unless
        the save goes to the memory tier only), and give each rank its files' prefix (DCP's ``__<rank>_``)."""
        tier = None
        if self.tier is not None:
            tier = _TierPlan(time.time(), self.tier.runtime.count_save(), len(plans))
        if tier is None or tier.durable:
            self._watched(
                "preparing", lambda place, _: commit.prepare_folder(place.root, place.folder, place.path, DCP_COMMIT)
            )
        self._facts = _SaveFacts(uuid.uuid4().hex, tier)
        store = Coordinator().store if len(plans) > 1 else None
        if store is not None:
            store.set(_facts_key(self.place), self._facts.to_json())
        world = len(plans)
        offers = [p.storage_data if isinstance(p.storage_data, kept_budget.Offer) else None for p in plans]
        agreed = kept_budget.agree([o.bytes if o is not None else None for o in offers])
        return [
            dataclasses.replace(
                p,
                storage_data=_RankFiles(
                    i, f"__{i}_", world, (o.ticket, agreed) if o is not None and agreed is not None else None
                ),
            )
            for i, (p, o) in enumerate(zip(plans, offers, strict=True))
        ]

    def _save_facts(self, files: _RankFiles) -> _SaveFacts:
        """This save's facts: the coordinator's own, or, on another rank, those it set on the store."""
        if self._is_coordinator or files.world_size == 1:
            assert self._facts is not None, "prepare_global_plan runs on the coordinator before write_data"
            return self._facts
        store = Coordinator().store
        assert store is not None, "a save of several ranks runs in a process group"
        self._facts = _SaveFacts.from_json(store.get(_facts_key(self.place)))
        return self._facts

    def _forget_facts(self, world_size: int) -> None:
        """Coordinator, once every rank's ``write_data`` has ended: the save's facts leave the store."""
        store = Coordinator().store if world_size > 1 else None
        if store is not None:
            store.delete_key(_facts_key(self.place))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's files, durable, and its manifest, before the future is returned (already done); the
        coordinator then waits, under the deadline, until every rank's ``write_data`` has ended (``checkin``)."""
        files: _RankFiles = plan.storage_data
        if files.snapshot_budget is not None:  # the stager keeps it from its next save on
            kept_budget.answer(*files.snapshot_budget)
        self._rank = files.rank
        facts = self._save_facts(files)
        check_in = WrittenCheckIn(facts.save_key, files.rank, files.world_size)
        try:
            results, records = self._watched(
                f"writing rank {files.rank}'s files of",
                lambda place, monitor: self._write_rank(place, monitor, plan, planner),
            )
        except BaseException as e:
            try:
                check_in.check_in()  # the failure itself reaches every rank through DCP's gather
            except Exception as late:  # late as well: this rank's own failure is what its caller needs
                e.add_note(f"(and: {late})")
            raise
        check_in.check_in()
        if self._is_coordinator:
            check_in.watch(f"DCP checkpoint {self.path}", self.timeout_s)
            self._check_in = check_in
        manifest = b"" if records is None else manifest_bytes(self.place.folder, files.rank, records)
        index = MetadataIndex(f"{_RECORDS_FQN}/{files.rank}")
        kept = _RankRecords(files.rank, records, manifest)
        results.append(WriteResult(index=index, size_in_bytes=0, storage_data=kept))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank's ``write_data`` (``results``: each rank's, through DCP's gather): the
        ranks' records checked, the index and ``.metadata``'s record written, ``.metadata`` last, then the commit."""
        check_in, self._check_in = self._check_in, None
        if check_in is not None:
            check_in.finish(self.timeout_s)
        per_rank: dict[int, _RankRecords] = {}
        storage_data = {}
        for rank_results in results:
            for r in rank_results:
                if isinstance(r.storage_data, _RankRecords):
                    if r.storage_data.records is not None:
                        per_rank[r.storage_data.rank] = r.storage_data
                else:
                    storage_data[r.index] = r.storage_data
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        data = pickle.dumps(metadata)
        self._forget_facts(len(results))
        tier, self._tier_save = self._tier_save, None
        if tier is None or self._durable:
            commit_ = _Commit(data, per_rank, len(results), self._rank, needed)
            self._watched("committing", lambda place, _: commit_.run(place))
        if tier is not None:
            self._watched("committing to the memory tier", lambda place, _: _seal_tier(tier, place.folder, data))

    def _watched(self, what: str, fn: Callable[[CheckpointPlace, StorageMonitor], T]) -> T:
        """``fn(place, monitor)`` on a helper thread, every storage call of ``place`` (and of the memory tier's
        copies) under this writer's deadline (a stalled or overdue call raises here, naming the file)."""
        monitor = StorageMonitor(f"{what} DCP checkpoint {self.path}", self.timeout_s, url=self.place.root.url)
        return run_watched(lambda: fn(self.place.watched(monitor), monitor), monitor, name="nxd_ckpt_dcp")

    def _write_rank(
        self, place: CheckpointPlace, monitor: StorageMonitor, plan: SavePlan, planner: SavePlanner
    ) -> tuple[list[WriteResult], dict[str, FileRecord] | None]:
        """This rank's items into the folder (``_write_files``), or through the memory tier (``_write_tier``); and
        the records of the files that reached the folder (None: none did)."""
        files: _RankFiles = plan.storage_data
        tier = self._facts.tier if self._facts is not None else None
        self._durable = tier is None or tier.durable
        if tier is None:
            storage = ChecksummingStorage(place.staged(), place.folder, files.rank)
            with storage.durability_batch():
                results = self._write_files(storage, place.folder, plan, planner)
            storage.write_manifest()
            return results, storage.records
        return self._write_tier(place, monitor, plan, planner)

    def _write_tier(
        self, place: CheckpointPlace, monitor: StorageMonitor, plan: SavePlan, planner: SavePlanner
    ) -> tuple[list[WriteResult], dict[str, FileRecord] | None]:
        """This rank's files into its node's memory, copied to the folder on a durable save; then (every rank but
        the coordinator, which does it in ``finish`` after ``.metadata``) its marker and the peers' copies."""
        files: _RankFiles = plan.storage_data
        decided = self._facts.tier if self._facts is not None else None
        assert self.tier is not None and decided is not None
        tier = self.tier.runtime.begin_save(place.folder, decided.created_at, decided.world_size, monitor)
        tier.begin()
        results = self._write_files(tier.storage, place.folder, plan, planner)
        records = None
        if decided.durable:
            durable = ChecksummingStorage(place.staged(), place.folder, files.rank)
            with durable.durability_batch():
                tier.copy_to(durable)
            durable.write_manifest()
            records = durable.records
        if self._is_coordinator:
            self._tier_save = tier
        else:
            tier.seal()
            tier.replicate()
        return results, records

    def _write_files(self, storage: Storage, folder: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Write this rank's items into ``thread_count`` files of ``storage``."""
        files: _RankFiles = plan.storage_data
        buckets = [b for b in _split(plan.items, self.thread_count) if b]
        names = [f"{files.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]

        def write(named: tuple[str, list[WriteItem]]) -> list[WriteResult]:
            return _write_file(storage, folder, named[0], named[1], planner)

        pairs = list(zip(names, buckets, strict=True))
        if len(pairs) <= 1:
            results = [write(p) for p in pairs]
        else:
            with ThreadPoolExecutor(len(pairs), thread_name_prefix="nxd_dcp_write") as pool:
                results = list(pool.map(write, pairs))
        return [r for file_results in results for r in file_results]


@dataclasses.dataclass(frozen=True)
class _Commit:
    """The coordinator's commit of a save: ``.metadata`` (pickled), every rank's records (``per_rank``, gathered in
    the write results), the world size, the coordinator's rank and what ``.metadata`` points at (``needed``: file ->
    end of its last item)."""

    metadata: bytes
    per_rank: dict[int, _RankRecords]
    world_size: int
    coordinator: int
    needed: dict[str, int]

    def run(self, place: CheckpointPlace) -> None:
        """Each rank's files recorded as written (in memory: no request per rank); the combined index,
        ``.metadata``'s record at its fixed place and the coordinator's manifest (listing ``.metadata`` too, for
        ``verify``), durably; then the commit the NxD path makes too (``commit.complete_folder``): ``.metadata``
        last, atomically and durably, the staged folder swapped in. A fixed number of storage requests, whatever
        the number of ranks."""
        staged, folder, coordinator = place.staged(), place.folder, self.coordinator
        records = {rank: kept.records for rank, kept in self.per_rank.items() if kept.records is not None}
        check_recorded(records, self.world_size, self.needed, place.path)
        own = {**records[coordinator], METADATA: FileRecord(*hash_bytes(self.metadata), coordinator)}
        own_manifest = manifest_bytes(folder, coordinator, own)
        parts = (own_manifest if rank == coordinator else kept.manifest for rank, kept in sorted(self.per_rank.items()))
        staged.write_bytes(layout.dcp_index_file(folder), index_bytes(folder, parts))
        record = layout.dcp_metadata_record_file(folder)
        staged.write_bytes(record, manifest_bytes(folder, coordinator, {METADATA: own[METADATA]}))
        staged.write_bytes(layout.manifest_file(folder, coordinator), own_manifest)
        staged.sync_dirs([record.rsplit("/", 1)[0]])
        commit.complete_folder(staged, folder, self.metadata, place.root if place.is_staged else None, DCP_COMMIT)


def _seal_tier(tier: TierSave, folder: str, metadata: bytes) -> None:
    """The coordinator's part of a save in the memory tier: ``.metadata`` into its node's share, then its manifest
    and marker (the copy of the whole save counts from now: every other rank sealed before ``finish``), then the
    peers' copies."""
    tier.storage.write_bytes(f"{folder}/{METADATA}", metadata)
    tier.seal()
    tier.replicate()


def _split(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into ``bins`` files: byte items round robin, tensors largest first into the emptiest file."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True)
    for item in tensors:
        slot = sizes.index(min(sizes))
        buckets[slot].append(item)
        sizes[slot] += _item_bytes(item)
    return buckets


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return int(torch.Size(data.size).numel()) * torch._utils._element_size(data.properties.dtype)


def _write_file(
    storage: Storage, folder: str, name: str, items: list[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """One ``.distcp`` file: each item's bytes (tensors as ``torch.save`` writes them), recorded as DCP does.
    Each item starts a new checksum block (``cut_block``, where the storage records block digests), so a load
    reads and checks exactly the blocks of the items it needs."""
    results = []
    with storage.open_write(f"{folder}/{name}") as f:
        cut_block = getattr(f, "cut_block", None)
        for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):  # bytes first, as DCP does
            if cut_block is not None:
                cut_block()
            offset = f.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                f.write(data.getbuffer() if isinstance(data, io.BytesIO) else data)
            else:
                tensor = data.detach().cpu()
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # a view: torch.save would write its whole storage
                torch.save(tensor, f)
            length = f.tell() - offset
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            )
        return results
