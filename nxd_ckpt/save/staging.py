"""Async saves' staging: turn a save's state trees into copies that no later training step can change.

CPU tensors are copied into host buffers kept from the previous save (``StagingPool``, the role of DCP's
``AsyncStager.stage``), matched by the tensor's position in the save and its shape and dtype, so a steady training
loop allocates (and first-touches) its staging memory once, not on every save. At most ``max_sets`` buffer sets
exist (a save being written plus the one being staged); ``clear`` gives the memory back.

Device tensors (XLA, a native accelerator) are snapshotted on the device within the device snapshot budget
(``device.snapshot``): the call waits for that copy only, and ``StagedState.transfer`` brings it to the host on a
background thread while training goes on. Their places in the staged trees hold data-less stand-ins that the
writers hand to ``transfer.host``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt import pages
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import SnapshotBudget, kind, native_device, on_device
from nxd_ckpt.device.pinned import PinnedArena, PinnedPool
from nxd_ckpt.device.transfer import DeviceTransfer, stand_in
from nxd_ckpt.ranks.deadlines import Deadline, resolve_timeout
from nxd_ckpt.tree import iter_tensors, map_tensors


def _close_quietly(snapshot: device_snapshot.Snapshot | None) -> None:
    """Stop a device snapshot's transfer when its save fails before the writer takes it (the save's own error is
    the one raised)."""
    if snapshot is not None:
        with contextlib.suppress(BaseException):
            snapshot.transfer.close()


def _copyable(t: torch.Tensor) -> bool:
    """Dense CPU tensors are copied into pooled buffers; anything else (sparse, quantized...) is cloned."""
    return t.layout == torch.strided and not t.is_quantized


@dataclass
class _BufferSet:
    """Host buffers of one staged save; ``buffers[i]`` holds the i-th distinct CPU tensor of that save."""

    generation: int
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


@dataclass
class StagedState:
    """The training-safe copy of one save's trees; ``release`` hands its host buffers back to the pool."""

    trees: list[Any]
    nbytes: int
    """Bytes of tensor data in the snapshot (each distinct tensor once)."""
    allocated_bytes: int
    """Bytes of host memory newly allocated by this staging (0 when every buffer was reused)."""
    copy_s: float
    _pool: StagingPool | None = field(default=None, repr=False)
    _set: _BufferSet | None = field(default=None, repr=False)
    snapshot: device_snapshot.Snapshot | None = None
    """Device state: its snapshot on the device (sizes, budget) and the transfer bringing it to the host."""

    @property
    def transfer(self) -> DeviceTransfer | None:
        """The device snapshot's host copies, arriving on a background thread (None without device tensors)."""
        return self.snapshot.transfer if self.snapshot is not None else None

    def release(self) -> None:
        """Hand the buffers back to the pool once the files are written; the trees are invalid after."""
        pool, buffer_set, self._pool, self._set = self._pool, self._set, None, None
        if pool is not None and buffer_set is not None:
            pool._give_back(buffer_set)


def _copy_into(buffer_set: _BufferSet, tensors: list[torch.Tensor], staged: dict[int, torch.Tensor]) -> int:
    """Copy ``tensors`` into ``buffer_set``, each into a buffer of its shape and dtype (the set's own, in
    order, else a new one; buffers left over are dropped); record each copy in ``staged`` by the source's id;
    return the bytes newly allocated.

    New buffers (the first save, a changed layout) are faulted in by helper threads ahead of the copy
    (``_Populator``): first-touch page faults, not the copy, are most of a first staging's time."""
    spare: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
    for buf in reversed(buffer_set.buffers):
        spare.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
    buffers: list[torch.Tensor] = []
    fresh: list[int] = []
    for i, t in enumerate(tensors):
        reusable = spare.get((tuple(t.shape), t.dtype))
        if reusable:
            buffers.append(reusable.pop())
        else:
            buffers.append(torch.empty(t.shape, dtype=t.dtype))  # reserved, not yet touched
            fresh.append(i)
    buffer_set.buffers = buffers
    with _Populator([buffers[i] for i in fresh]) as populator, torch.no_grad():
        for i, t in enumerate(tensors):
            populator.wait_for(buffers[i])
            buffers[i].copy_(t.detach())
            staged[id(t)] = buffers[i]
    return sum(buffers[i].numel() * buffers[i].element_size() for i in fresh)


class _Populator:
    """Faults in new staging buffers on helper threads (``pages.populate``: one kernel call per piece, GIL
    released, instead of one fault per 4 KiB page), in the order the copy will need them; ``wait_for`` blocks
    until a buffer is done. Without the call (other systems, old kernels) the copy takes the faults itself."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._pending: dict[int, list[Any]] = {}
        self._pool: Any = None
        big = [b for b in buffers if b.numel() * b.element_size() >= pages.MIN_BYTES]
        if not big or pages.known_unsupported():
            return
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=_POPULATE_THREADS, thread_name_prefix="nxd_ckpt_populate")
        for b in big:
            start = b.data_ptr()
            self._pending[id(b)] = [
                self._pool.submit(pages.populate, lo, hi)
                for lo, hi in pages.pieces(start, start + b.numel() * b.element_size(), _POPULATE_PIECE)
            ]

    def wait_for(self, buffer: torch.Tensor) -> None:
        for future in self._pending.pop(id(buffer), ()):
            future.result()

    def __enter__(self) -> _Populator:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


_POPULATE_PIECE = 32 << 20
_POPULATE_THREADS = 4


class StagingPool:
    """Reusable host staging memory for async saves, bounded to ``max_sets`` sets of buffers.

    ``stage`` blocks while all sets are lent out (a save is being written and another is already staged),
    which bounds staging memory to ``max_sets`` times the rank's state.
    """

    def __init__(self, max_sets: int = 2) -> None:
        if max_sets < 1:
            raise ValueError(f"max_sets must be >= 1, got {max_sets}")
        self.max_sets = max_sets
        self._cond = threading.Condition()
        self._free: list[_BufferSet] = []
        self._lent = 0
        self._generation = 0
        self._prepared: pages.Prefaulter | None = None
        self.pinned = PinnedPool()
        """Pinned host buffers of native-accelerator snapshots' transfers, kept across saves like the sets."""
        self._arena: PinnedArena | None = None

    def pinned_arena(
        self, capacity: int, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]
    ) -> PinnedArena:
        """The pinned memory of saves under a host memory budget of ``capacity`` bytes (native accelerators): kept
        across saves, replaced when the budget changes, dropped by ``clear``."""
        with self._cond:
            if self._arena is None or self._arena.capacity != capacity or self._arena.lent_bytes:
                self._arena = PinnedArena(capacity, allocate)
            return self._arena

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory in free (reusable) buffer sets."""
        with self._cond:
            return sum(s.nbytes for s in self._free)

    def stage(
        self,
        trees: Sequence[Any],
        timeout: float | None = None,
        needed: Sequence[int] | None = None,
        device_budget: SnapshotBudget | None = None,
        rank: int | None = None,
    ) -> StagedState:
        """Copy ``trees`` to memory no later training step can modify; same structure.

        A tensor object that appears several times (tied weights) is staged once and stays shared. With ``needed``
        (ids of tensors, in the order the writers read them), other tensors are not copied: they become data-less
        ``meta`` tensors of the same shape and dtype (writers of a DP replica's xser share only look at the others'
        metadata), so any attempt to read their data fails instead of writing something stale. Device tensors are
        snapshotted on the device within ``device_budget`` (default: what the device reports free) and reach the
        host through ``StagedState.transfer``, in the order of ``needed``: a writer waiting for a tensor that a
        later chunk brings holds its thread while tensors already on the host wait to be written. Waits for a
        free buffer set and for the transfer last at most ``timeout`` (default: the library's deadline) and then
        raise ``CheckpointTimeoutError`` naming ``rank``.
        """
        deadline = Deadline(resolve_timeout(timeout), rank)
        unique: dict[int, torch.Tensor] = {}
        skipped: dict[int, torch.Tensor] = {}
        order = {tid: i for i, tid in enumerate(dict.fromkeys(needed))} if needed is not None else {}
        for tree in trees:
            for _, t in iter_tensors(tree):
                if needed is None or id(t) in order:
                    unique.setdefault(id(t), t)
                elif id(t) not in skipped:
                    skipped[id(t)] = stand_in(t)
        device = sorted((t for t in unique.values() if on_device(t)), key=lambda t: order.get(id(t), 0))
        host_cpu = [t for t in unique.values() if t.device.type == "cpu" and _copyable(t)]
        start = time.perf_counter()
        snapshot = None
        staged: dict[int, torch.Tensor] = {}
        if device:
            budget = device_budget if device_budget is not None else SnapshotBudget(None)
            snapshot = device_snapshot.take(device, budget, pool=self.pinned, deadline=deadline)
            staged.update(snapshot.stand_ins)
        try:
            buffer_set = self._acquire(deadline) if host_cpu else None
        except BaseException:
            _close_quietly(snapshot)
            raise
        allocated = 0
        if buffer_set is not None:
            try:
                allocated = _copy_into(buffer_set, host_cpu, staged)
            except BaseException:
                self._give_back(buffer_set)
                _close_quietly(snapshot)
                raise
        for t in unique.values():
            if id(t) not in staged:
                staged[id(t)] = t.detach().clone()
        copy_s = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in staged.values())
        staged.update(skipped)
        out = [map_tensors(tree, lambda t: staged[id(t)]) for tree in trees]
        return StagedState(out, nbytes, allocated, copy_s, _pool=self, _set=buffer_set, snapshot=snapshot)

    def prepare(
        self,
        trees: Sequence[Any],
        snapshot_of: Sequence[torch.Tensor] = (),
        device_budget: SnapshotBudget | None = None,
    ) -> int:
        """Reserve the buffers the next ``stage`` of ``trees`` (or of a part of them) copies into and fault them
        in on a background thread, so that the first async save of a process copies into touched memory like
        every later one. Returns the bytes reserved: 0 when the pool already holds or lends out a set. The
        buffers are the pool's: an unused one is dropped by the first save (or by ``clear``). A native
        accelerator's tensors get their pinned buffers (``PinnedPool.reserve``) instead. The XLA tensors of
        ``snapshot_of`` (those the save will snapshot on this rank) get their snapshot within ``device_budget``
        (the saves' own: ``KeptSnapshotBudget.for_warm_up``; None: none) taken once (``device.snapshot.warm``):
        its graph is then compiled, which the first save would otherwise do in its call."""
        unique: dict[int, torch.Tensor] = {}
        native: dict[int, torch.Tensor] = {}
        for tree in trees:
            for _, t in iter_tensors(tree):
                if t.device.type == "cpu" and _copyable(t):
                    unique.setdefault(id(t), t)
                elif kind(t) == "native":
                    native.setdefault(id(t), t)
        on_xla = [t for t in snapshot_of if kind(t) == "xla"]
        if on_xla and device_budget is not None:
            device_snapshot.warm(on_xla, device_budget)
        pinned = 0
        if native:
            device = native_device(list(native.values()))
            assert device is not None
            pinned = self.pinned.reserve(list(native.values()), device.staging_empty)
        with self._cond:
            if self._free or self._lent or not unique:
                return pinned
            buffer_set = _BufferSet(generation=self._generation)
            buffer_set.buffers = [torch.empty(t.shape, dtype=t.dtype) for t in unique.values()]
            self._free.append(buffer_set)
            self._cond.notify_all()
        # Faulted in beside the training loop, at nice 19: first touch is paid there, not in the first save.
        self._prepared = pages.Prefaulter(buffer_set.buffers, low_priority=True)
        return buffer_set.nbytes + pinned

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Whether the buffers of the last ``prepare`` are faulted in (waits up to ``timeout`` s)."""
        return self._prepared.wait(timeout) if self._prepared is not None else True

    def clear(self) -> None:
        """Free every buffer; sets still lent out are dropped when they come back."""
        if self._prepared is not None:
            self._prepared.close()  # stops within one piece: no populating of memory being freed
        self.pinned.clear()
        with self._cond:
            self._arena = None
            self._free.clear()
            self._generation += 1

    def _acquire(self, deadline: Deadline) -> _BufferSet:
        with self._cond:
            deadline.wait(
                self._cond,
                lambda: bool(self._free) or self._lent < self.max_sets,
                "staging an async save",
                f"one of the {self.max_sets} staging buffer sets, all in use: the previous saves are still being "
                "written",
            )
            self._lent += 1
            if self._free:
                return self._free.pop()
            return _BufferSet(generation=self._generation)

    def _give_back(self, buffer_set: _BufferSet) -> None:
        with self._cond:
            self._lent -= 1
            if buffer_set.generation == self._generation:
                self._free.append(buffer_set)
            self._cond.notify_all()
