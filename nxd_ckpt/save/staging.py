"""Device-to-host staging: turn a state tree into host (CPU) tensors that training cannot change.

XLA tensors are materialised with one sync for the whole tree and moved in bulk transfers; CPU tensors are
copied only when the snapshot must outlive the call (async saves), because ``state_dict()`` returns live
references that the optimizer updates in place.

Async saves stage through a ``StagingPool`` (the role of DCP's ``AsyncStager.stage``): CPU tensors are copied
into host buffers kept from the previous save, matched by the tensor's position in the save and its shape and
dtype, so a steady training loop allocates (and first-touches) its staging memory once, not on every save.
At most ``max_sets`` buffer sets exist (a save being written plus the one being staged); ``clear`` gives the
memory back. Transfers from an XLA device already produce private host tensors (torch_xla has no transfer
into a caller's buffer), so those are used as the snapshot directly instead of being copied a second time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt import knobs, pages, xla
from nxd_ckpt.statefile import LoadTarget
from nxd_ckpt.tree import iter_tensors, map_tensors


def has_device_tensors(tree: Any) -> bool:
    return any(t.device.type != "cpu" for _, t in iter_tensors(tree))


def to_host(tree: Any, *, copy: bool) -> Any:
    """A copy of ``tree`` whose tensors are on the CPU; with ``copy`` CPU tensors are cloned too."""
    device_tensors = {id(t): t for _, t in iter_tensors(tree) if t.device.type != "cpu"}
    host: dict[int, torch.Tensor] = {}
    if device_tensors:
        host = _bulk_to_cpu(list(device_tensors.values()))

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return host[id(t)]
        return t.detach().clone() if copy else t.detach()

    return map_tensors(tree, convert)


def device_loads_enabled() -> bool:
    """Whether loads stream device targets through ``DeviceLoadTarget`` (transfers on the reader threads):
    ``NXD_CKPT_XLA_TRANSFER_THREAD`` (0 places device tensors after reading, no streaming through host buffers)."""
    return knobs.xla_transfer_thread()


class HostFetcher:
    """Host copies of a synchronous save's device tensors, made ahead of the writes on a background thread.

    The save syncs the device once (in the constructor), then a thread moves tensors to the host in bulk
    batches, in the order given (the order the writers need them), while writer threads already write the
    first ones: the transfer and the disk overlap instead of adding up. ``host(t)`` blocks until ``t``'s copy
    exists; tensors not in ``order`` (e.g. other DP replicas' xser shares) are never transferred. The training
    thread is blocked in the save meanwhile, so this thread is the only one using the device.
    ``background=False`` (or ``NXD_CKPT_XLA_TRANSFER_THREAD=0``) transfers everything on the caller's thread
    first, for runtimes where device transfers must stay on one thread.
    """

    def __init__(
        self, order: Sequence[torch.Tensor], batch_bytes: int | None = None, background: bool | None = None
    ) -> None:
        distinct = list({id(t): t for t in order if t.device.type != "cpu"}.values())
        self._xla = [t for t in distinct if xla.is_xla(t)]
        self._copies: dict[int, torch.Tensor] = {
            id(t): t.detach().to("cpu") for t in distinct if not xla.is_xla(t)
        }  # other devices: plain copies, now
        self._error: BaseException | None = None
        self._reported = False  # a writer already raised the transfer error
        self._done = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if background is None:
            background = knobs.xla_transfer_thread()
        if self._xla:
            xla.sync(self._xla)  # one execution for all of them, before returning to the caller
            if background:
                self._thread = threading.Thread(target=self._run, args=(batch_bytes,), name="nxd_ckpt_d2h", daemon=True)
                self._thread.start()
            else:  # everything now, on the caller's thread (no overlap with the writes)
                self._run(batch_bytes)
                self.close_error_now()
        else:
            self._done = True

    def _run(self, batch_bytes: int | None) -> None:
        try:
            for batch, copies in xla.iter_to_cpu(self._xla, batch_bytes, synced=True):
                with self._cond:
                    for i, copy in zip(batch, copies, strict=True):
                        self._copies[id(self._xla[i])] = copy
                    self._cond.notify_all()
        except BaseException as e:  # raised in every writer waiting for a copy, and by close()
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host: CPU tensors as they are, device tensors once their copy has arrived."""
        if t.device.type == "cpu":
            return t.detach()
        with self._cond:
            while id(t) not in self._copies:
                if self._error is not None:
                    self._reported = True
                    raise RuntimeError(f"copying the state to the host failed: {self._error}") from self._error
                if self._done:  # not in the planned order: copy it now (the transfer thread has finished)
                    self._copies[id(t)] = xla.to_cpu([t])[0] if xla.is_xla(t) else t.detach().to("cpu")
                    break
                self._cond.wait()
            return self._copies[id(t)]

    def close_error_now(self) -> None:
        """Raise the transfer error, if any, right away (the caller's thread did the transfer)."""
        if self._error is not None:
            self._reported = True
            raise RuntimeError(f"copying the state to the host failed: {self._error}") from self._error

    def close(self) -> None:
        """Wait for the transfer thread and drop the host copies; raise its error if nobody saw it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._copies.clear()
        if self._error is not None and not self._reported:
            error, self._error = self._error, None
            raise RuntimeError(f"copying the state to the host failed: {error}") from error


def _metadata_only(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor with ``t``'s shape, dtype and NxD's expert-parallel flag: no memory, no data."""
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    if getattr(t, "expert_model_parallel", False):
        meta.expert_model_parallel = True  # type: ignore[attr-defined]
    return meta


def _bulk_to_cpu(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Host copies by source id: XLA tensors with one sync and batched bulk transfers (``xla.to_cpu``)."""
    xla_tensors = [t for t in tensors if t.device.type == "xla"]
    out: dict[int, torch.Tensor] = {}
    if xla_tensors:
        cpu = xla.to_cpu(xla_tensors)
        out.update({id(t): c for t, c in zip(xla_tensors, cpu, strict=True)})
    for t in tensors:
        if id(t) not in out:
            out[id(t)] = t.detach().to("cpu")
    return out


def _close_quietly(fetcher: HostFetcher | None) -> None:
    """Stop a device snapshot's transfer when its save fails before the writer takes it (the save's own error
    is the one raised)."""
    if fetcher is not None:
        with contextlib.suppress(BaseException):
            fetcher.close()


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
    """The training-safe host copy of one save's trees; ``release`` hands its buffers back to the pool."""

    trees: list[Any]
    nbytes: int
    """Bytes of tensor data in the snapshot (each distinct tensor once)."""
    allocated_bytes: int
    """Bytes of host memory newly allocated by this staging (0 when every buffer was reused)."""
    copy_s: float
    _pool: StagingPool | None = field(default=None, repr=False)
    _set: _BufferSet | None = field(default=None, repr=False)
    fetcher: HostFetcher | None = None
    """With a device snapshot: the device copies' host copies, arriving on a background thread."""

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

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory in free (reusable) buffer sets."""
        with self._cond:
            return sum(s.nbytes for s in self._free)

    def stage(
        self,
        trees: Sequence[Any],
        timeout: float | None = None,
        needed: Collection[int] | None = None,
        device_snapshot: bool = False,
    ) -> StagedState:
        """Copy ``trees`` to host memory no later training step can modify; same structure, host tensors.

        A tensor object that appears several times (tied weights) is staged once and stays shared. With
        ``needed`` (ids of tensors), other tensors are not copied: they become data-less ``meta`` tensors of the
        same shape and dtype (writers of a DP replica's xser share only look at the others' metadata), so any
        attempt to read their data fails instead of writing something stale.

        With ``device_snapshot``, XLA tensors are copied on the device instead (one sync; ``xla.DeviceSnapshot``)
        and stay there: ``StagedState.fetcher`` brings them to the host in batches on a background thread, for
        the writer, while training goes on.
        """
        unique: dict[int, torch.Tensor] = {}
        skipped: dict[int, torch.Tensor] = {}
        for tree in trees:
            for _, t in iter_tensors(tree):
                if needed is None or id(t) in needed:
                    unique.setdefault(id(t), t)
                elif id(t) not in skipped:
                    skipped[id(t)] = _metadata_only(t)
        device = [t for t in unique.values() if t.device.type != "cpu"]
        host_cpu = [t for t in unique.values() if t.device.type == "cpu" and _copyable(t)]
        start = time.perf_counter()
        fetcher: HostFetcher | None = None
        if device_snapshot and any(xla.is_xla(t) for t in device):
            on_device = [t for t in device if xla.is_xla(t)]
            copies = xla.DeviceSnapshot(on_device).release_copies()
            staged = {id(t): c for t, c in zip(on_device, copies, strict=True)}
            fetcher = HostFetcher(copies, background=True)
            staged.update(_bulk_to_cpu([t for t in device if not xla.is_xla(t)]))
        else:
            staged = _bulk_to_cpu(device) if device else {}
        try:
            buffer_set = self._acquire(timeout) if host_cpu else None
        except BaseException:
            _close_quietly(fetcher)
            raise
        allocated = 0
        if buffer_set is not None:
            try:
                allocated = _copy_into(buffer_set, host_cpu, staged)
            except BaseException:
                self._give_back(buffer_set)
                _close_quietly(fetcher)
                raise
        for t in unique.values():
            if id(t) not in staged:
                staged[id(t)] = t.detach().clone()
        copy_s = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in staged.values())
        staged.update(skipped)
        out = [map_tensors(tree, lambda t: staged[id(t)]) for tree in trees]
        return StagedState(out, nbytes, allocated, copy_s, _pool=self, _set=buffer_set, fetcher=fetcher)

    def prepare(self, trees: Sequence[Any]) -> int:
        """Reserve the buffers the next ``stage`` of ``trees`` (or of a part of them) copies into and fault them
        in on a background thread, so that the first async save of a process copies into touched memory like
        every later one. Returns the bytes reserved: 0 when the pool already holds or lends out a set. The
        buffers are the pool's: an unused one is dropped by the first save (or by ``clear``)."""
        unique: dict[int, torch.Tensor] = {}
        for tree in trees:
            for _, t in iter_tensors(tree):
                if t.device.type == "cpu" and _copyable(t):
                    unique.setdefault(id(t), t)
        with self._cond:
            if self._free or self._lent or not unique:
                return 0
            buffer_set = _BufferSet(generation=self._generation)
            buffer_set.buffers = [torch.empty(t.shape, dtype=t.dtype) for t in unique.values()]
            self._free.append(buffer_set)
            self._cond.notify_all()
        # Faulted in beside the training loop, at nice 19: first touch is paid there, not in the first save.
        self._prepared = pages.Prefaulter(buffer_set.buffers, low_priority=True)
        return buffer_set.nbytes

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Whether the buffers of the last ``prepare`` are faulted in (waits up to ``timeout`` s)."""
        return self._prepared.wait(timeout) if self._prepared is not None else True

    def clear(self) -> None:
        """Free every buffer; sets still lent out are dropped when they come back."""
        if self._prepared is not None:
            self._prepared.close()  # stops within one piece: no populating of memory being freed
        with self._cond:
            self._free.clear()
            self._generation += 1

    def _acquire(self, timeout: float | None) -> _BufferSet:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._lent < self.max_sets, timeout):
                raise TimeoutError(
                    f"all {self.max_sets} staging buffer sets are still in use after {timeout} s: "
                    "the previous saves are still being written"
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


# ----------------------------------------------------------------------------------------------- loads


@dataclass
class _Arena:
    """One reused host buffer that tensors bound for the device are read into, side by side."""

    memory: torch.Tensor
    array: Any = None
    """``memory`` as a NumPy array (slices of it become tensors of their own)."""
    used: int = 0
    sealed: bool = False
    slots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(host view, device target) per tensor carved from it."""
    filled: int = 0

    @property
    def complete(self) -> bool:
        return self.sealed and self.filled == len(self.slots)


LOAD_ARENA_BYTES = 32 << 20
LOAD_ARENAS = 4
"""Loads onto a device stream through at most 4 host buffers of 32 MiB (fewer bytes when
NXD_CKPT_XLA_TRANSFER_BATCH_BYTES is smaller): measured on XLA:CPU, 32 MiB x 4 beat 64 MiB x 3 and
256 MiB x 2 (first touch of fresh buffers and the wait per transfer cost more than extra transfers)."""


class DeviceLoadTarget(LoadTarget):
    """A load target whose XLA tensors receive their bytes through a few reused host buffers.

    Each saved tensor bound for an XLA target tensor is read into a slice of a host arena (``arena_bytes``,
    default ``LOAD_ARENA_BYTES``); when an arena is full and all its tensors are read, the reader thread
    that completes it sends the whole arena to the device in one bulk transfer (``_xla_tensors_from_aten``)
    while the other readers go on reading, and each target tensor takes the transferred data in place
    (``_replace_xla_tensor``: the same Parameter object, no device-side copy, no second device copy of the
    state). At most ``arenas`` buffers exist: host memory stays bounded whatever the state's size. CPU targets
    are read into directly, as ``LoadTarget`` does. ``finish`` transfers the last arena; the loaded state then
    holds the target tensors themselves where it held their host copies.
    """

    def __init__(self, tree: Any, check: Any = None, arena_bytes: int | None = None, arenas: int = 2) -> None:
        super().__init__(tree, check)
        self.arena_bytes = arena_bytes if arena_bytes is not None else min(LOAD_ARENA_BYTES, xla.batch_bytes_from_env())
        self.max_arenas = max(1, arenas)
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []
        self._live = 0
        self._open: _Arena | None = None
        self._transfer_lock = threading.Lock()
        self._in_flight: _Arena | None = None
        self._error: BaseException | None = None
        self._arena_of: dict[int, _Arena] = {}
        self._targets: dict[int, torch.Tensor] = {}
        self._filled: set[int] = set()
        self.transfers = 0
        self.bytes_to_device = 0
        self.host_bytes_allocated = 0

    def dest(self, path: Any, like: torch.Tensor) -> torch.Tensor | None:
        target = self.tensors.get(path)
        if target is None or not xla.is_xla(target):
            return self.existing(path, like)
        if target.dtype != like.dtype or tuple(target.shape) != tuple(like.shape) or like.numel() == 0:
            return None
        return self._carve(target, like.numel() * like.element_size(), like)

    def result_for(self, result: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        """What the loaded state holds for a tensor read into ``dest``: its device target (which has, or gets by
        ``finish``, the data). A slot the reader did not fill (a layout it read into fresh memory instead) is
        dropped from its arena's transfer, and the host tensor is placed with the rest of the state."""
        drop: _Arena | None = None
        with self._cond:
            target = self._targets.pop(id(dest), None)
            if id(dest) in self._filled:
                self._filled.discard(id(dest))
                return target if target is not None else result
            arena = self._arena_of.get(id(dest))
            if arena is not None:
                arena.slots = [(v, t) for v, t in arena.slots if v is not dest]
                if arena.complete:
                    drop = arena
        if drop is not None:
            self._transfer(drop)
        return result

    def _carve(self, target: torch.Tensor, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """A host tensor for ``like``'s bytes in the open arena; seals a full one and waits for a free one."""
        padded = -(-nbytes // 64) * 64
        while True:
            to_transfer: _Arena | None = None
            with self._cond:
                self._raise_error()
                arena = self._open
                if arena is not None and arena.used + padded <= arena.memory.numel():
                    # A tensor of its own on the arena's memory (storage offset 0): the reader rebuilds it in place.
                    raw = torch.frombuffer(arena.array[arena.used : arena.used + nbytes], dtype=torch.uint8)
                    view = raw.view(like.dtype).view(like.shape)
                    arena.used += padded
                    arena.slots.append((view, target))
                    self._arena_of[id(view)] = arena
                    self._targets[id(view)] = target
                    return view
                if arena is not None:  # full: sealed, sent once its last tensor is read
                    arena.sealed = True
                    self._open = None
                    to_transfer = arena if arena.complete else None
                elif self._live < self.max_arenas:
                    memory = self._take_memory(padded)
                    self._open = _Arena(memory, memory.numpy())
                else:
                    self._cond.wait_for(
                        lambda: self._live < self.max_arenas or self._open is not None or self._error is not None
                    )
            if to_transfer is not None:
                self._transfer(to_transfer)

    def _take_memory(self, nbytes: int) -> torch.Tensor:
        """An arena's memory (under the lock): a free one that fits, else a new one."""
        self._live += 1
        for i, memory in enumerate(self._free):
            if memory.numel() >= nbytes:
                return self._free.pop(i)
        size = max(self.arena_bytes, nbytes)
        self.host_bytes_allocated += size
        return torch.empty(size, dtype=torch.uint8)

    def filled(self, dest: torch.Tensor) -> None:
        with self._cond:
            arena = self._arena_of.get(id(dest))
            if arena is None:  # a CPU target read in place
                return super().filled(dest)
            arena.filled += 1
            self._filled.add(id(dest))
            ready = arena.complete
        if ready:
            self._transfer(arena)

    def _transfer(self, arena: _Arena) -> None:
        """One bulk host->device transfer of the arena's tensors; the targets take the data in place.

        A transfer may still read the host memory after the call returns (PJRT keeps the source until it is
        done), so the arena is only reused after a wait for the device's pending work, taken at the next
        transfer (by then long finished, so the wait costs nothing) or by ``finish``.
        """
        try:
            with self._transfer_lock:
                if arena.slots:
                    module = xla.require("loading onto an XLA device")
                    views = [v for v, _ in arena.slots]
                    devices = [str(t.device) for _, t in arena.slots]
                    placed = module._XLAC._xla_tensors_from_aten(views, devices)
                    for (_, target), new in zip(arena.slots, placed, strict=True):
                        module._XLAC._replace_xla_tensor(target, new)
                    self.transfers += 1
                    self.bytes_to_device += sum(v.numel() * v.element_size() for v in views)
                self._settle_in_flight(keep=arena)
        except BaseException as e:
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()
            self._release(arena)
            raise

    def _settle_in_flight(self, keep: _Arena | None = None) -> None:
        """(Under the transfer lock.) Wait for the previous transfer, give its arena back; ``keep`` is in flight."""
        previous, self._in_flight = self._in_flight, keep
        if previous is not None:
            module = xla.require("loading onto an XLA device")
            module._XLAC._xla_wait_device_ops([])
            self._release(previous)

    def _release(self, arena: _Arena) -> None:
        with self._cond:
            for view, _ in arena.slots:
                self._arena_of.pop(id(view), None)
            arena.slots = []
            self._live -= 1
            if len(self._free) < self.max_arenas and arena.memory.numel() <= self.arena_bytes:
                self._free.append(arena.memory)
            self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"copying the loaded state to the device failed: {self._error}") from self._error

    def finish(self, state: Any) -> Any:
        """After every read succeeded: transfer the last arena, raise a transfer error, free the arenas."""
        with self._cond:
            arena, self._open = self._open, None
            if arena is not None:
                arena.sealed = True
        if arena is not None and arena.slots:
            self._transfer(arena)
        with self._transfer_lock:
            self._settle_in_flight()
        with self._cond:
            self._raise_error()
            self._free.clear()
        return super().finish(state)
