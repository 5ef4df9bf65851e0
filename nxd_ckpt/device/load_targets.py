"""Load targets: the tensors a load reads straight into, on the host or on a device.

``LoadTarget`` lands each saved tensor in the existing CPU tensor at the same path (a live model's parameters, an
optimizer's state). ``DeviceLoadTarget`` does the same for device tensors through a few reused host buffers
("arenas") that the readers fill while earlier arenas travel to the device: XLA by bulk transfers whose data the
target tensors take in place, a native accelerator (CUDA) by non-blocking copies from pinned arenas on a side
stream that the training stream waits for at the end (each reader thread that sends an arena makes the targets'
device current first).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt import knobs, tree, xla
from nxd_ckpt.device.backend import NativeDevice, kind, on_device
from nxd_ckpt.serialization import readinto
from nxd_ckpt.tree import map_tensors

Path = tree.Path


def tensor_paths(state: Any) -> Iterator[tuple[Path, torch.Tensor]]:
    """(path, tensor) for every tensor of nested state; a path is the tuple of keys/indices (``tree.leaves``)."""
    return tree.leaves(state)


def device_loads_enabled() -> bool:
    """Whether loads stream device targets through ``DeviceLoadTarget`` (transfers on the reader threads):
    ``NXD_CKPT_XLA_TRANSFER_THREAD`` (0 places device tensors after reading, no streaming through host buffers)."""
    return knobs.xla_transfer_thread()


class LoadTarget:
    """Tensors that already exist (a live model's parameters, an optimizer's state, a dict's tensors), which a
    load reads straight into: a saved tensor lands in the target tensor at the same path in the state, when
    that one is a contiguous CPU tensor of the same dtype and shape. Others load into fresh memory as before.

    ``check(meta_state)`` runs on the saved state's structure (data-less ``meta`` tensors) before any byte lands
    in a target, so a state that does not fit (strict key checks) fails before the model is touched.
    ``DeviceLoadTarget`` stage device targets through bounded host buffers.
    """

    def __init__(self, tree: Any, check: Callable[[Any], None] | None = None) -> None:
        self.tensors: dict[Path, torch.Tensor] = dict(tensor_paths(tree))
        self._check = check
        self.direct = True
        """Whether reads may bypass the page cache (not when replicas on this host read the same files)."""
        self.bytes_in_place = 0

    def check(self, meta_state: Any) -> None:
        if self._check is not None:
            self._check(meta_state)

    def dest(self, path: Path, like: torch.Tensor) -> torch.Tensor | None:
        """The tensor ``like`` (saved at ``path``) should be read into, or None for fresh memory."""
        return self.existing(path, like)

    def existing(self, path: Path, like: torch.Tensor) -> torch.Tensor | None:
        """The target's own CPU tensor at ``path`` when ``like``'s bytes can land in it as they are."""
        t = self.tensors.get(path)
        if t is None or t.device.type != "cpu" or t.dtype != like.dtype or tuple(t.shape) != tuple(like.shape):
            return None
        return t.detach() if t.is_contiguous() and t.storage_offset() == 0 else None

    def filled(self, dest: torch.Tensor) -> None:
        """``dest`` holds its bytes now."""
        self.bytes_in_place += dest.numel() * dest.element_size()

    def result_for(self, result: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        """What the loaded state holds for a tensor read into ``dest`` (``result`` aliases it)."""
        return result

    def abandon(self, dest: torch.Tensor) -> None:
        """``dest`` was chosen but will not be filled (its read failed or fell back): nothing to undo here."""

    def finish(self, state: Any) -> Any:
        """Once every read of the load succeeded: ``state`` with the target's own tensors wherever a loaded CPU
        tensor did not land in place (small tensors kept inside xser reference files, fallbacks) but fits
        one: those are copied in, so every target tensor keeps its memory. Device targets also transfer
        what is left in host memory first."""
        swaps: dict[int, torch.Tensor] = {}
        for path, loaded in tensor_paths(state):
            dest = self.existing(path, loaded)
            if dest is None or id(loaded) in swaps:
                continue
            if loaded.device.type == "cpu" and not _same_memory(loaded, dest):
                with torch.no_grad():
                    dest.copy_(loaded)
            swaps[id(loaded)] = self.tensors[path]
        return map_tensors(state, lambda t: swaps.get(id(t), t)) if swaps else state

    def chooser(self) -> readinto.Chooser:
        def choose(meta: Any) -> dict[int, torch.Tensor]:
            self.check(meta)
            out = {}
            for path, t in tensor_paths(meta):
                dest = self.dest(path, t)
                if dest is not None:
                    out[id(t)] = dest
            return out

        return choose


def _same_layout(target: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``like``'s bytes can become ``target``'s as they are (same dtype and shape, not empty)."""
    return target.dtype == like.dtype and tuple(target.shape) == tuple(like.shape) and like.numel() > 0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


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
    event: Any = None
    """A native device's event recorded after the arena's copies were enqueued (the arena is reusable once done)."""

    @property
    def complete(self) -> bool:
        return self.sealed and self.filled == len(self.slots)


LOAD_ARENA_BYTES = 32 << 20
LOAD_ARENAS = 4
"""Loads onto a device stream through at most 4 host buffers of 32 MiB (fewer bytes when
NXD_CKPT_XLA_TRANSFER_BATCH_BYTES is smaller): measured on XLA:CPU, 32 MiB x 4 beat 64 MiB x 3 and
256 MiB x 2 (first touch of fresh buffers and the wait per transfer cost more than extra transfers); again
on 2026-11-27 (0.45 GB, xser, medians of 5): 4 x 32 MiB 0.52 s, 2 x 32 MiB 0.53 s, 4 x 64 MiB 0.64 s,
3 x 128 MiB 0.67 s. ``DeviceLoadTarget``'s default (the loads' targets were built with 2 until then)."""


class DeviceLoadTarget(LoadTarget):
    """A load target whose device tensors receive their bytes through a few reused host buffers.

    Each saved tensor bound for a device target tensor is read into a slice of a host arena (``arena_bytes``,
    default ``LOAD_ARENA_BYTES``); when an arena is full and all its tensors are read, the reader thread that
    completes it sends the whole arena to the device while the other readers go on reading. XLA: one bulk
    transfer (``_xla_tensors_from_aten``), and each target tensor takes the transferred data in place
    (``_replace_xla_tensor``: the same Parameter object, no device-side copy, no second device copy of the
    state). A native accelerator: the arenas are pinned, and each target is filled by a non-blocking copy on a
    side stream (the training stream waits for it in ``finish``). At most ``arenas`` buffers exist: host memory
    stays bounded whatever the state's size. CPU targets are read into directly, as ``LoadTarget`` does.
    ``finish`` transfers the last arena; the loaded state then holds the target tensors themselves where it held
    their host copies.
    """

    def __init__(self, tree: Any, check: Any = None, arena_bytes: int | None = None, arenas: int = LOAD_ARENAS) -> None:
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
        self._carved_paths: dict[int, Path] = {}
        """id(slice) -> its path, for slices carved when a streamed record was reached (``chooser``)."""
        self._placed: set[Path] = set()
        """Paths whose device target has received (or is receiving) its bytes through a deferred slice."""
        self.transfers = 0
        self.bytes_to_device = 0
        self.host_bytes_allocated = 0
        natives = {t.device for t in self.tensors.values() if kind(t) == "native"}
        self._native = NativeDevice(next(iter(natives))) if len(natives) == 1 else None
        self._side: Any = None
        self._training_stream = self._native.current_stream() if self._native is not None else None
        """The stream of the thread that builds the target (the training thread): copies start after its work and
        it waits for them in ``finish``."""

    def dest(self, path: Any, like: torch.Tensor) -> torch.Tensor | None:
        target = self.tensors.get(path)
        if not self._bound_for_device(target):
            return self.existing(path, like)
        if not _same_layout(target, like):
            return None
        return self._carve(target, like.numel() * like.element_size(), like)

    def _bound_for_device(self, target: torch.Tensor | None) -> bool:
        """Whether ``target`` is a device tensor this target streams to (else a CPU target or none)."""
        return target is not None and on_device(target) and (kind(target) != "native" or self._native is not None)

    def chooser(self) -> readinto.Chooser:
        """For a ``torch.save`` file streamed whole: each device-bound tensor's slice of an arena is carved only
        when its record is reached, so a file larger than the arenas streams through them (carving every slice
        when ``data.pkl`` is read would wait for arenas that only reading the records before them frees)."""

        def choose(meta: Any) -> dict[int, torch.Tensor | readinto.Deferred]:
            self.check(meta)
            out: dict[int, torch.Tensor | readinto.Deferred] = {}
            for path, like in tensor_paths(meta):
                target = self.tensors.get(path)
                if not self._bound_for_device(target):
                    dest = self.existing(path, like)
                    if dest is not None:
                        out[id(like)] = dest
                elif _same_layout(target, like):
                    carve = self._deferred_carve(path, target, like)
                    out[id(like)] = readinto.Deferred(like.dtype, tuple(like.shape), carve)
            return out

        return choose

    def _deferred_carve(self, path: Path, target: torch.Tensor, like: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The carve of ``path``'s slice, for when its record is read; the slice's path is kept so that ``finish``
        puts the target itself where the loaded state holds the slice (the arena's memory is reused after)."""

        def carve() -> torch.Tensor:
            view = self._carve(target, like.numel() * like.element_size(), like)
            with self._cond:
                self._carved_paths[id(view)] = path
            return view

        return carve

    def result_for(self, result: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        """What the loaded state holds for a tensor read into ``dest``: its device target (which has, or gets by
        ``finish``, the data). A slot the reader did not fill (a layout it read into fresh memory instead) is
        dropped from its arena's transfer, and the host tensor is placed with the rest of the state."""
        with self._cond:
            if id(dest) in self._filled:
                target = self._targets.pop(id(dest), None)
                self._filled.discard(id(dest))
                return target if target is not None else result
        self.abandon(dest)
        return result

    def abandon(self, dest: torch.Tensor) -> None:
        """``dest``'s slice will not be filled (its read failed or went to fresh memory): it leaves its arena,
        which then travels once its other slices are read, so readers waiting for a free arena go on."""
        drop: _Arena | None = None
        with self._cond:
            self._targets.pop(id(dest), None)
            self._carved_paths.pop(id(dest), None)
            if id(dest) in self._filled:  # filled before the read failed: it travels with its arena
                self._filled.discard(id(dest))
                return
            arena = self._arena_of.pop(id(dest), None)
            if arena is not None:
                arena.slots = [(v, t) for v, t in arena.slots if v is not dest]
                if arena.complete:
                    drop = arena
        if drop is not None:
            self._transfer(drop)

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
        if self._native is not None:
            return self._native.pinned_empty((size,), torch.uint8)
        return torch.empty(size, dtype=torch.uint8)

    def filled(self, dest: torch.Tensor) -> None:
        with self._cond:
            arena = self._arena_of.get(id(dest))
            if arena is None:  # a CPU target read in place
                return super().filled(dest)
            arena.filled += 1
            self._filled.add(id(dest))
            path = self._carved_paths.pop(id(dest), None)
            if path is not None:
                self._placed.add(path)
            ready = arena.complete
        if ready:
            self._transfer(arena)

    def _transfer(self, arena: _Arena) -> None:
        """Send the arena's tensors to the device: the targets take the data in place.

        A transfer may still read the host memory after the call returns (PJRT keeps the source until it is done;
        a native copy runs on its stream), so the arena is only reused after a wait for it, taken at the next
        transfer (by then long finished, so the wait costs nothing) or by ``finish``.
        """
        try:
            with self._on_device(), self._transfer_lock:
                if arena.slots:
                    views = [v for v, _ in arena.slots]
                    xla_slots = [(v, t) for v, t in arena.slots if kind(t) == "xla"]
                    native_slots = [(v, t) for v, t in arena.slots if kind(t) == "native"]
                    if xla_slots:
                        _place_xla(xla_slots)
                    if native_slots:
                        arena.event = self._copy_native(native_slots)
                    self.transfers += 1
                    self.bytes_to_device += sum(v.numel() * v.element_size() for v in views)
                self._settle_in_flight(keep=arena)
        except BaseException as e:
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()
            self._release(arena)
            raise

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The native targets' device made current on the calling thread (a reader thread starts on device 0)."""
        return self._native.guard() if self._native is not None else contextlib.nullcontext()

    def _copy_native(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Enqueue pinned -> device copies on the side stream (after the training stream's earlier work)."""
        native = self._native
        assert native is not None
        if self._side is None:
            self._side = native.new_stream()
            self._side.wait_event(native.record(self._training_stream))
        with native.on(self._side), torch.no_grad():
            for view, target in slots:
                target.copy_(view, non_blocking=True)
        return native.record(self._side)

    def _settle_in_flight(self, keep: _Arena | None = None) -> None:
        """(Under the transfer lock.) Wait for the previous transfer, give its arena back; ``keep`` is in flight."""
        previous, self._in_flight = self._in_flight, keep
        if previous is not None:
            if previous.event is not None:
                previous.event.synchronize()
            if any(kind(t) == "xla" for _, t in previous.slots):
                xla.require("loading onto an XLA device")._XLAC._xla_wait_device_ops([])
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
        with self._on_device(), self._transfer_lock:
            self._settle_in_flight()
            if self._side is not None and self._native is not None:  # training's next kernels see the loaded bytes
                self._training_stream.wait_event(self._native.record(self._side))
        with self._cond:
            self._raise_error()
            self._free.clear()
        if self._placed:  # the state holds slices of reused arenas there: the targets hold the bytes
            placed = {id(t): self.tensors[p] for p, t in tensor_paths(state) if p in self._placed}
            state = map_tensors(state, lambda t: placed.get(id(t), t))
        return super().finish(state)


def _place_xla(slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One bulk host -> XLA transfer of the views; each target takes its new data in place."""
    module = xla.require("loading onto an XLA device")
    views = [v for v, _ in slots]
    placed = module._XLAC._xla_tensors_from_aten(views, [str(t.device) for _, t in slots])
    for (_, target), new in zip(slots, placed, strict=True):
        _settle_alias_updates(target)
        module._XLAC._replace_xla_tensor(target, new)


def _settle_alias_updates(target: torch.Tensor) -> None:
    """Apply an in-place update made through an alias of ``target`` (``p.detach().zero_()``, ``dcp.load`` into a
    state dict) before its data is replaced: functionalization would otherwise regenerate ``target`` from that
    alias at its next use, and the loaded bytes would be lost."""
    sync = getattr(torch, "_functionalize_sync", None)
    if sync is not None:
        with contextlib.suppress(RuntimeError):  # not a functional tensor: nothing is pending
            sync(target)
