"""``Stager``: DCP's ``AsyncStager`` over the library's staging: ``dcp.async_save`` blocks only for a device snapshot
(accelerator state) or a copy into reused host buffers (CPU state), within the host and device budgets.

``stage`` runs on the training thread. It hands the state to ``save.staging.StagingPool.stage``: CPU tensors are
copied into host buffers kept from the previous save; device tensors are copied on the device within the device
snapshot budget (``device.snapshot.take``), and ``device.transfer.DeviceTransfer`` brings the copies to the host on
the process's transfer thread, into pinned buffers kept across saves. Sharded ``DTensor`` state (FSDP2, TP) is
staged as its local shards and rebuilt with the same mesh, placements, shape and stride. Other leaves are deep
copies. ``stage`` returns a ``Future`` of the staged state dict, done when every host copy has arrived (at once for
CPU state): DCP's upload thread waits for it, the training thread does not; training may change the live state as
soon as ``stage`` (``dcp.async_save``) returns.

The device snapshot follows the NxD path's rules (docs/async.md): its budget is one decision per state layout
(``device.kept_budget``), agreed as the ranks' least in DCP's own plan gather of a save and kept from the next save
on (``StorageWriter`` carries it: no round of its own; DCP stages before any collective of the save, so the first
save of a layout snapshots within this rank's own proposal); an out-of-memory in the snapshot moves the rest by the
direct transfer, is logged and reported (``last_report.device_snapshot_fallback``) and halves the kept budget; on
XLA a save called before the step's sync first runs the pending step once (``xla.run_pending_step``), as the
user's sync would, instead of a sync of the state alone that would run the step a second time at the user's sync.

The staged copies are the pool's buffers: they go back to it when DCP drops the staged state dict (the upload
ended, or failed), which the stager sees through a weak reference to each staged tensor. A save waits (under the
deadline) while two earlier saves, or more than ``host_memory_budget`` bytes of them, still hold their copies.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager

from nxd_ckpt import xla
from nxd_ckpt.device import kept_budget
from nxd_ckpt.device.backend import SnapshotBudget, nbytes, resolve_snapshot_budget
from nxd_ckpt.device.backend import on_device as is_on_device
from nxd_ckpt.device.kept_budget import KeptSnapshotBudget
from nxd_ckpt.device.transfer import run_on_transfer_thread
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.options import resolve_budget
from nxd_ckpt.ranks.coordinator import world_rank
from nxd_ckpt.ranks.deadlines import Deadline, resolve_timeout
from nxd_ckpt.save.staging import StagedState, StagingPool
from nxd_ckpt.tree import children, leaves, map_leaves, map_tensors

MAX_IN_FLIGHT = 2
"""Saves whose staged copies may exist at once (one being written, one staged): the pool's buffer sets."""

logger = logging.getLogger("nxd_ckpt")


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What one ``Stager.stage`` did (``Stager.last_report``), as ``SaveReport`` says it for ``save_checkpoint``."""

    blocked_s: float = 0.0
    """Seconds the call spent copying (the device snapshot, or the copy into host buffers)."""
    allocated_bytes: int = 0
    """Host bytes newly allocated for CPU state (0 once the pool's buffers are reused)."""
    ran_pending_step: bool = False
    """The XLA state had a pending graph (a save before the step's sync): the step ran once, here."""
    device_budget_bytes: int = 0
    """The device snapshot budget this save used (the ranks' agreed one once a save's plan gather brought it)."""
    device_snapshot_bytes: int = 0
    """Bytes copied on the device (the snapshot)."""
    device_direct_bytes: int = 0
    """Bytes moved to the host by the call itself (beyond the budget, or after an out-of-memory)."""
    device_snapshot_fallback: str | None = None
    """The snapshot ran out of device memory: what was not cloned moved directly, and the kept budget shrank."""


def _is_dtensor(t: torch.Tensor) -> bool:
    """A ``DTensor`` (told by its interface: this package imports only torch.distributed.checkpoint)."""
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def _local(t: torch.Tensor) -> torch.Tensor:
    """What is staged of ``t``: a DTensor's local shard, else ``t`` itself."""
    if not _is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined]


def _rebuild(original: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """``staged`` as ``original`` was: a DTensor with the same mesh, placements, shape and stride for a DTensor."""
    if not _is_dtensor(original):
        return staged
    with torch.no_grad():
        return type(original).from_local(  # type: ignore[attr-defined]
            staged,
            original.device_mesh,  # type: ignore[attr-defined]
            original.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=original.shape,
            stride=original.stride(),
        )


def _copy_leaf(value: Any) -> Any:
    """A non-tensor leaf as it is now: training may change a mutable one after the call returns."""
    return value if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class _Lease:
    """One save's staged copies, lent to DCP until every staged tensor handed out is gone; then given back."""

    def __init__(self, stager: Stager, staged: StagedState, nbytes: int) -> None:
        self._stager = stager
        self._staged: StagedState | None = staged
        self.nbytes = nbytes
        self._alive = 0
        self._refs: list[weakref.ref] = []
        self._lock = threading.Lock()

    def watch(self, tensors: list[torch.Tensor]) -> None:
        """Give the copies back once all of ``tensors`` (the staged state dict's) are garbage."""
        self._alive = len(tensors)
        self._refs = [weakref.ref(t, self._one_gone) for t in tensors]  # cheaper than weakref.finalize per tensor
        if not tensors:
            self.end()

    def _one_gone(self, _ref: weakref.ref | None = None) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        if last:
            self.end()

    def end(self) -> None:
        """The copies back to the pool (pinned ones too); an error met here goes to the stager's next call."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        try:
            staged.release()
            if staged.transfer is not None:
                staged.transfer.close()
        except BaseException as e:  # kept for the next stage()
            self._stager._record_error(e)
        finally:
            self._stager._returned(self)


class Stager(AsyncStager):
    """DCP's ``AsyncStager`` with the library's device snapshot and reused host staging buffers.

    >>> # xdoctest: +SKIP
    >>> stager = nxd_ckpt.dcp.Stager()
    >>> response = dcp.async_save(state, storage_writer=nxd_ckpt.dcp.StorageWriter(path), async_stager=stager)
    >>> response.upload_completion.result()  # training may go on as soon as async_save returns
    >>> stager.close()  # after the last save

    Args:
        host_memory_budget: the most host memory (bytes, or a size such as ``"8GiB"``) the staged copies of the
            saves in flight hold together; default ``NXD_CKPT_HOST_MEMORY_BUDGET``, else no limit (two saves'
            worth at most). A rank whose state alone exceeds it is refused (DCP needs the whole copy).
        device_snapshot_budget: device memory for the snapshot (bytes, a size, ``"auto"``; None:
            ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET``); what does not fit is copied to the host within the call.
        timeout: seconds a save waits for earlier saves' copies to be given back (default ``NXD_CKPT_TIMEOUT_S``).
    """

    _synchronize_after_execute = False  # stage returns a Future: DCP's upload thread waits for it

    def __init__(
        self,
        host_memory_budget: int | str | None = None,
        device_snapshot_budget: int | str | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        self.host_memory_budget = resolve_budget(host_memory_budget)
        self.device_snapshot_budget = resolve_snapshot_budget(device_snapshot_budget)
        self.timeout_s = resolve_timeout(timeout)
        self.pool = StagingPool(max_sets=MAX_IN_FLIGHT)
        self._kept = KeptSnapshotBudget()
        self._cond = threading.Condition()
        self._leases: set[_Lease] = set()
        self._error: BaseException | None = None
        self._closed = False
        self.last_allocated_bytes = 0
        """Host bytes the last ``stage`` newly allocated for CPU state (0 once the pool's buffers are reused)."""
        self.last_blocked_s = 0.0
        """Seconds the last ``stage`` spent copying (the snapshot, or the copy into host buffers)."""
        self.last_report = StageReport()
        """What the last ``stage`` did: its device snapshot, a fallback after an out-of-memory, a pending step."""

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only (a stager pickled with the objects around it): the staged copies, their pool and the
        threads that move them belong to this process, so a copy starts with its own, empty pool."""
        return {
            "host_memory_budget": self.host_memory_budget,
            "device_snapshot_budget": self.device_snapshot_budget,
            "timeout_s": self.timeout_s,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        Stager.__init__(self, timeout=state["timeout_s"])
        self.host_memory_budget = state["host_memory_budget"]
        self.device_snapshot_budget = state["device_snapshot_budget"]

    def stage(self, state_dict: STATE_DICT_TYPE) -> Future[STATE_DICT_TYPE]:  # type: ignore[override]
        """The training-safe copy of ``state_dict``, as a Future done once its host copies have arrived."""
        self._raise_earlier()
        originals = [t for _, t in leaves(state_dict)]  # one walk serves the size, the device state and _Finish
        sharded = any(_is_dtensor(t) for t in originals)
        local = map_tensors(state_dict, _local) if sharded else state_dict
        distinct = list({id(t): t for t in ([t for _, t in leaves(local)] if sharded else originals)}.values())
        size = sum(nbytes(t) for t in distinct)
        deadline = Deadline(self.timeout_s, world_rank())
        self._wait_for_room(size, deadline)
        on_device = [t for t in distinct if is_on_device(t)]  # as device_tensors: distinct, in tree order
        ran_pending_step = xla.run_pending_step(on_device)  # before the snapshot reads the state: once, as a sync
        budget = self._snapshot_budget(on_device)
        staged = self.pool.stage([local], timeout=self.timeout_s, device_budget=budget, rank=deadline.rank)
        self.last_report = self._report(staged, ran_pending_step, deadline.rank)
        if on_device:
            kept_budget.offer(self._kept.ticket, self._kept.bytes or 0)  # for this save's plan gather to carry
        lease = _Lease(self, staged, size)
        with self._cond:
            self._leases.add(lease)
        try:
            skeleton = map_leaves(staged.trees[0], _copy_leaf, lambda v: children(v) is None)
        except BaseException:
            lease.end()
            raise
        future: Future[STATE_DICT_TYPE] = Future()
        job = _Finish(future, lease, staged, skeleton, originals)
        if staged.transfer is None:
            job()
        else:
            run_on_transfer_thread(job)  # after the transfer the snapshot queued there
        return future

    def _snapshot_budget(self, on_device: list[torch.Tensor]) -> SnapshotBudget | None:
        """The device snapshot budget of the device tensors ``on_device``: one decision per state layout
        (``KeptSnapshotBudget``), this rank's proposal until a save's plan gather brings the ranks' agreement
        (``kept_budget.answer_for``), which is kept from then on."""
        if not on_device:
            return None
        kept = self._kept
        proposal = kept.proposal(self.device_snapshot_budget, on_device)
        kept.take_answer(kept_budget.answer_for(kept.ticket))
        return SnapshotBudget(kept.bytes if kept.bytes is not None else proposal)

    def _report(self, staged: StagedState, ran_pending_step: bool, rank: int) -> StageReport:
        """What the staging did; a snapshot that ran out of device memory is logged and shrinks the kept budget
        (``KeptSnapshotBudget.shrink``: the next saves propose half of what was cloned)."""
        self.last_allocated_bytes, self.last_blocked_s = staged.allocated_bytes, staged.copy_s
        snapshot = staged.snapshot
        if snapshot is None:
            return StageReport(staged.copy_s, staged.allocated_bytes, ran_pending_step)
        fallback = snapshot.fallback
        if fallback is not None:
            smaller = self._kept.shrink(snapshot.snapshot_bytes)
            fallback = f"{fallback}; the next saves propose a budget of {smaller} bytes"
            logger.warning("async DCP save on rank %d: %s", rank, fallback)
        return StageReport(
            staged.copy_s, staged.allocated_bytes, ran_pending_step, snapshot.budget_bytes, snapshot.snapshot_bytes,
            snapshot.direct_bytes, fallback,
        )  # fmt: skip

    def _wait_for_room(self, size: int, deadline: Deadline) -> None:
        """Wait (under ``deadline``, whose error names this rank) until the saves in flight leave room for ``size``
        bytes more (fewer than ``MAX_IN_FLIGHT`` saves, within the host budget); CheckpointError for a state the
        budget can never hold."""
        limit = self.host_memory_budget
        if limit is not None and size > limit:
            raise CheckpointError(
                f"this rank's state needs {size} bytes of host memory to be staged, more than "
                f"host_memory_budget={limit}: an async DCP save holds a whole copy of it until it is written; raise "
                "the budget (NXD_CKPT_HOST_MEMORY_BUDGET), or save with dcp.save, which needs no copy"
            )

        def room() -> bool:
            held = sum(lease.nbytes for lease in self._leases)
            return len(self._leases) < MAX_IN_FLIGHT and (limit is None or held + size <= limit)

        with self._cond:
            if room():
                return
        gc.collect()  # a staged state dict kept only by a reference cycle (a failed upload's traceback)
        with self._cond:
            held = sum(lease.nbytes for lease in self._leases)
            deadline.wait(
                self._cond,
                room,
                "staging an async DCP save",
                f"the staged copies of {len(self._leases)} earlier async saves ({held} bytes), still held: their "
                "uploads have not finished, or something keeps their staged state dicts (an upload future's "
                "exception holds them); wait for upload_completion before the next save, or drop the failed futures",
            )

    def _returned(self, lease: _Lease) -> None:
        with self._cond:
            self._leases.discard(lease)
            self._cond.notify_all()

    def _record_error(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error

    def _raise_earlier(self) -> None:
        """Raise what a background step of an earlier save met after its future was settled, and refuse a closed
        stager."""
        if self._closed:
            raise CheckpointError("this nxd_ckpt.dcp.Stager was closed; make a new one for more saves")
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(
                f"an earlier async save's staging failed after it was handed to DCP ({type(error).__name__}: {error}); "
                "that save's copies were dropped; this save was not started: save again"
            ) from error

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a Future (DCP waits for it on its upload thread)."""

    def close(self) -> None:
        """Free the pool's buffers (those lent to a save still running are dropped when it ends)."""
        self._closed = True
        self.pool.clear()


class _Finish:
    """Builds the staged state dict once the host copies have arrived (on the transfer thread, or at once) and
    settles the future with it; the lease watches what it hands out."""

    def __init__(
        self,
        future: Future[STATE_DICT_TYPE],
        lease: _Lease,
        staged: StagedState,
        skeleton: Any,
        originals: list[torch.Tensor],
    ) -> None:
        self.future, self.lease, self.staged, self.skeleton, self.originals = future, lease, staged, skeleton, originals

    def __call__(self) -> None:
        try:
            out, handed = self._build()
        except BaseException as e:  # the future carries it to DCP's upload and the caller
            self.lease.end()
            self.future.set_exception(e)
            return
        finally:
            self.skeleton = self.originals = None  # type: ignore[assignment]
        self.lease.watch(handed)
        self.future.set_result(out)

    def _build(self) -> tuple[Any, list[torch.Tensor]]:
        """The state dict with host copies (aliases of the pool's buffers) in place of stand-ins, DTensors rebuilt."""
        transfer = self.staged.transfer
        snapshot = self.staged.snapshot
        stand_ins = {id(s) for s in snapshot.stand_ins.values()} if snapshot is not None else set()
        position = iter(self.originals)
        aliases: dict[int, torch.Tensor] = {}
        rebuilt: dict[int, torch.Tensor] = {}

        def place(t: torch.Tensor) -> torch.Tensor:
            original = next(position)
            if id(original) in rebuilt:
                return rebuilt[id(original)]
            host = transfer.host(t) if transfer is not None and id(t) in stand_ins else t
            if id(host) not in aliases:
                aliases[id(host)] = host.detach()  # an object of our own: its death gives the buffer back
            rebuilt[id(original)] = _rebuild(original, aliases[id(host)])
            return rebuilt[id(original)]

        out = map_tensors(self.skeleton, place)
        return out, list(rebuilt.values())
