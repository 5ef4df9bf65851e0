"""An async save's snapshot of device state: a copy on the device, taken on the training thread, that travels to the
host beside training.

On the training thread, ``take`` copies every device tensor that fits the snapshot budget on the device (XLA: a
``clone`` each and one sync that materialises them all, launched and not waited for; a native accelerator:
``clone`` kernels enqueued on the training stream, nothing waited for) and returns a ``DeviceTransfer`` that
brings the copies to the host on a background thread, chunk by chunk, freeing each chunk's device copies once it
has arrived. Later training steps cannot reach the copies: in-place updates and XLA's buffer donation touch the
originals only, and the device runs them after the copies.

Tensors that do not fit the budget are moved to the host before ``take`` returns, in chunks: XLA by bulk
transfers on the training thread (as before device snapshots), a native accelerator by non-blocking copies into
pinned buffers on a side stream that the training stream then waits for (so training's next kernels cannot
overwrite them, while the call itself returns at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt import xla
from nxd_ckpt.device.backend import (
    NativeDevice,
    SnapshotBudget,
    distinct_storages,
    kind,
    native_device,
    nbytes,
    on_device,
    out_of_memory,
)
from nxd_ckpt.device.pinned import PinnedArena, PinnedPool
from nxd_ckpt.device.transfer import DeviceTransfer, stand_in, start_transfer_thread
from nxd_ckpt.ranks.deadlines import Deadline


@dataclass
class Snapshot:
    """What ``take`` made: stand-ins for the device tensors and the transfer that brings their bytes over."""

    stand_ins: dict[int, torch.Tensor]
    """``id`` of each device tensor -> the ``meta`` tensor writers ask ``transfer.host`` for."""
    transfer: DeviceTransfer
    snapshot_bytes: int
    """Bytes copied on the device (the snapshot's extra device memory at its peak)."""
    direct_bytes: int
    """Bytes that did not fit the budget and were moved to the host (or queued to, native) by the call itself."""
    direct_s: float
    """Time the call spent on ``direct_bytes``."""
    budget_bytes: int
    budget_source: str
    fallback: str | None = None
    """Why part of what fit the budget moved by the direct transfer instead (the device ran out of memory in the
    snapshot); None when the snapshot went as planned."""


def split_by_budget(tensors: Sequence[torch.Tensor], budget: int) -> tuple[list[int], list[int]]:
    """Indices of the tensors copied on the device (in order, while they fit in ``budget``) and of the rest."""
    fit: list[int] = []
    rest: list[int] = []
    used = 0
    for i, t in enumerate(tensors):
        if used + nbytes(t) <= budget:
            fit.append(i)
            used += nbytes(t)
        else:
            rest.append(i)
    return fit, rest


def take(
    tensors: Sequence[torch.Tensor],
    budget: SnapshotBudget,
    *,
    pool: PinnedPool | None = None,
    chunk_bytes: int | None = None,
    deadline: Deadline | None = None,
) -> Snapshot:
    """Snapshot the device ``tensors`` (distinct objects, in the order the writers need them) and start their
    transfer. Tensors over one storage (tied weights) are copied and moved once (``distinct_storages``); each still
    gets a stand-in, whose host copy is a copy of its own (the files keep one tensor per key, as NxD writes them).
    ``deadline`` bounds every wait for the transfer."""
    device_kind = _device_kind(tensors)
    start_transfer_thread()  # before the device gets busy with the copies (the first save of a process)
    first, alias_of = distinct_storages(tensors)
    all_keys = [stand_in(t) for t in tensors]
    links = {"aliases": {id(all_keys[j]): all_keys[i] for j, i in alias_of.items()}, "deadline": deadline}
    copied, keys = [tensors[i] for i in first], [all_keys[i] for i in first]
    limit, source = budget.resolve(copied)
    fit, rest = split_by_budget(copied, limit)
    start = time.perf_counter()
    if device_kind == "xla":
        transfer, fit, rest, fallback = _take_xla(copied, keys, fit, rest, chunk_bytes, links)
    else:
        native = native_device(copied)
        assert native is not None
        with native.guard():
            transfer, fit, rest, fallback = _take_native(native, copied, keys, fit, rest, pool, chunk_bytes, links)
    return Snapshot(
        stand_ins={id(t): k for t, k in zip(tensors, all_keys, strict=True)},
        transfer=transfer,
        snapshot_bytes=sum(nbytes(copied[i]) for i in fit),
        direct_bytes=sum(nbytes(copied[i]) for i in rest),
        direct_s=time.perf_counter() - start if rest else 0.0,
        budget_bytes=limit,
        budget_source=source,
        fallback=fallback,
    )


def _fallback_reason(error: BaseException, moved_bytes: int) -> str:
    """``Snapshot.fallback``: the out-of-memory met, and what moved by the direct transfer instead."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return (
        f"the device ran out of memory in the snapshot ({type(error).__name__}: {first_line}); {moved_bytes} bytes "
        "moved by the direct transfer instead"
    )


def _clone_while_memory_lasts(
    tensors: Sequence[torch.Tensor], fit: list[int]
) -> tuple[list[torch.Tensor], list[int], str | None]:
    """A native device's clones of ``tensors[i]`` for ``fit``, in order, until the device runs out of memory:
    (the clones, the indices left uncloned, why) -- those move by the direct transfer."""
    clones: list[torch.Tensor] = []
    with torch.no_grad():
        for n, i in enumerate(fit):
            try:
                clones.append(tensors[i].detach().clone())
            except Exception as e:
                if not out_of_memory(e):
                    raise
                return clones, fit[n:], _fallback_reason(e, sum(nbytes(tensors[j]) for j in fit[n:]))
    return clones, [], None


def _launch_xla_copies_or_none(
    tensors: Sequence[torch.Tensor], fit: list[int], rest: list[int], *, wait: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], str | None]:
    """``_launch_xla_copies``; where the runtime reports an out-of-memory in it (at the graph's compile or launch;
    one in its asynchronous execution surfaces later), no clones and the reason: everything stays live."""
    try:
        clones, live = _launch_xla_copies(tensors, fit, rest, wait=wait)
    except Exception as e:
        if not out_of_memory(e):
            raise
        return [], [], _fallback_reason(e, sum(nbytes(tensors[i]) for i in fit))
    return clones, live, None


@dataclass
class DeviceCopies:
    """What ``copy_on_device`` made for a save under a host memory budget: device copies that a background thread
    brings to the host piece by piece (``fetch``), as the budget allows."""

    sources: dict[int, torch.Tensor]
    """``id`` of each live device tensor that fit the snapshot budget -> its copy on the device."""
    snapshot_bytes: int
    budget_bytes: int
    direct_bytes: int = 0
    """Bytes of the distinct device storages left live (not copied on the device): the save's call stages them."""
    native: NativeDevice | None = None
    fallback: str | None = None
    """As ``Snapshot.fallback``: the copies that did not fit in device memory stay live (the call stages them)."""
    ready: Any = None
    """A native device's event recorded after the clones (the first fetch's copies wait for it)."""
    arena: PinnedArena | None = None
    """A native device's pinned memory for the host copies (the budget's worth, kept across saves)."""
    side: Any = None
    _side_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    """Makes ``side`` and its wait for ``ready`` once: the transfer thread and the writers all fetch."""

    def fetch(self, copies: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of some of ``sources``' values (any thread; XLA: one bulk transfer, which waits for the
        clones' execution; native: non-blocking copies on a side stream after the clones' kernels, into pieces of
        ``arena`` where one is free, else into pageable memory, under the copies' device)."""
        if not copies:
            return []
        if kind(copies[0]) == "xla":
            return xla.fetch(copies)
        native = self.native
        assert native is not None
        out: list[torch.Tensor] = []
        with native.guard():
            side = self._side_stream(native)
            with native.on(side), torch.no_grad():
                for c in copies:
                    piece = self.arena.take(c) if self.arena is not None else None
                    if piece is None:
                        piece = torch.empty(c.shape, dtype=c.dtype)
                    piece.copy_(c, non_blocking=True)
                    out.append(piece)
            native.record(side).synchronize()
        return out

    def _side_stream(self, native: NativeDevice) -> Any:
        """The stream the copies run on, made by the first fetch, which also makes it wait for the clones; a fetch
        on another thread meanwhile waits for both (else it could copy on a stream that never waited)."""
        with self._side_lock:
            if self.side is None:
                side = native.new_stream()
                if self.ready is not None:
                    side.wait_event(self.ready)
                    self.ready = None
                self.side = side
            return self.side

    def room(self, sizes: Sequence[int]) -> int:
        """How many host copies of these sizes (bytes, in order) ``fetch`` would put in ``arena`` now; all of them
        without an arena (pageable memory is always there)."""
        return self.arena.placeable(sizes) if self.arena is not None else len(sizes)

    def give_back(self, copy: torch.Tensor) -> None:
        """A host copy ``fetch`` made is no longer read: its pinned piece (if any) serves later copies."""
        if self.arena is not None:
            self.arena.give_back(copy)


def copy_on_device(
    tensors: Sequence[torch.Tensor], budget: SnapshotBudget, arena: PinnedArena | None = None
) -> DeviceCopies:
    """On the training thread: a copy on the device of each of ``tensors`` (device tensors, in the writers' order)
    that fits ``budget``, launched and not waited for (XLA: the clones under one sync; native: clone kernels on the
    training stream). The rest stay live: the save's call stages them itself. Tensors over one storage (tied
    weights) get one copy, which ``sources`` maps each of them to. ``arena``: pinned memory that a native device's
    copies are fetched into."""
    device_kind = _device_kind(tensors)
    first, alias_of = distinct_storages(tensors)  # tied weights: one device copy, which every alias is mapped to
    aliases = [tensors[j] for j in alias_of]
    tensors = [tensors[i] for i in first]
    limit, _source = budget.resolve(tensors)
    fit, _rest = split_by_budget(tensors, limit)
    native = ready = None
    if device_kind == "xla":
        clones, _, fallback = _launch_xla_copies_or_none(
            [tensors[i] for i in fit], list(range(len(fit))), [], wait=False
        )
    else:
        native = native_device(tensors)
        assert native is not None
        with native.guard():
            clones, _, fallback = _clone_while_memory_lasts(tensors, fit)
            ready = native.record(native.current_stream())
    fit = fit[: len(clones)]
    sources = {id(tensors[i]): c for i, c in zip(fit, clones, strict=True)}
    for alias, j in zip(aliases, alias_of.values(), strict=True):
        original = id(tensors[first.index(j)])
        if original in sources:
            sources[id(alias)] = sources[original]
    return DeviceCopies(
        sources=sources,
        snapshot_bytes=sum(nbytes(tensors[i]) for i in fit),
        direct_bytes=sum(nbytes(t) for t in tensors) - sum(nbytes(tensors[i]) for i in fit),
        budget_bytes=limit,
        native=native,
        fallback=fallback,
        ready=ready,
        arena=arena if native is not None else None,
    )


def _device_kind(tensors: Sequence[torch.Tensor]) -> str:
    """The one device kind of ``tensors`` (``xla`` or ``native``); raises for host tensors or a mix of kinds."""
    if not all(on_device(t) for t in tensors):
        raise ValueError(
            "a device snapshot takes device tensors only (XLA or an accelerator's); host tensors are staged"
        )
    kinds = {kind(t) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"one rank's state spans device kinds {sorted(kinds)}; expected one device per rank")
    return kinds.pop() if kinds else "xla"


def graph_order(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The order in which a snapshot's copies enter XLA's graph: by dtype and shape, so that the compiled graph
    depends on the state's shapes only (not on the order a save's files list them), and ``warm`` can compile it
    before the first save."""
    return sorted(range(len(tensors)), key=lambda i: _layout(tensors[i]))


def _layout(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """What a tensor contributes to the snapshot graph: its dtype and shape (``graph_order`` sorts by it)."""
    return str(t.dtype), tuple(t.shape)


def warm(tensors: Sequence[torch.Tensor], budget: SnapshotBudget) -> int:
    """Take, once and at once, the snapshot an async save of these device ``tensors`` takes, and drop it: its
    graph is then compiled and cached (XLA), and the first save does not compile it in its call. (torch_xla's
    compile-only ``_xla_warm_up_cache`` hashes a graph apart from a sync's, so it would not serve the save.)
    A native accelerator compiles nothing. Nothing is done while a tensor has a pending graph (called between an
    optimizer step and its ``mark_step``): the clones' graph would hold the step's, and not be the save's. Returns
    the bytes the snapshot covered."""
    on_xla = [t for t in tensors if kind(t) == "xla"]
    xla_tensors = [on_xla[i] for i in distinct_storages(on_xla)[0]]  # as ``take`` copies them
    if not xla_tensors or xla.pending(xla_tensors):
        return 0
    fit, rest = split_by_budget(xla_tensors, budget.resolve(xla_tensors)[0])
    if not fit:  # nothing would be copied on the device: no snapshot graph to compile
        return 0
    if _graph_key(xla_tensors, fit, rest) not in _launched_graphs:  # else compiled already: by a save or a warm
        _launch_xla_copies(xla_tensors, fit, rest, wait=True)
    return sum(nbytes(xla_tensors[i]) for i in fit)


_launched_graphs: set[tuple] = set()
"""``_graph_key`` of every snapshot graph this process ran (so compiled): ``warm`` does not run one again (a
resume's preparation, then Lightning's after the first step, cost one clone of the state, not two)."""


def _graph_key(tensors: Sequence[torch.Tensor], fit: list[int], rest: list[int]) -> tuple:
    """What the snapshot graph of ``_launch_xla_copies`` depends on: the dtypes and shapes of the copies, in graph
    order, and of the live tensors synced with them."""
    return tuple(sorted(_layout(tensors[i]) for i in fit)), tuple(_layout(tensors[i]) for i in rest)


def _launch_xla_copies(
    tensors: Sequence[torch.Tensor], fit: list[int], rest: list[int], *, wait: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The clones of ``fit`` and the live ``rest``, under one sync in ``graph_order`` (the graph ``warm`` and
    ``take`` must share); returns (clones, live) in the order of their indices."""
    key = _graph_key(tensors, fit, rest)
    # a state with a pending graph (a save before the step's mark_step) runs another graph, not this one
    compiles_the_snapshot = key not in _launched_graphs and not xla.pending(tensors)
    clones = [tensors[i].detach().clone() for i in fit]
    live = [tensors[i].detach() for i in rest]
    xla.sync([clones[j] for j in graph_order(clones)] + live, wait=wait)
    if compiles_the_snapshot:
        _launched_graphs.add(key)
    return clones, live


def _take_xla(
    tensors: Sequence[torch.Tensor],
    keys: list[torch.Tensor],
    fit: list[int],
    rest: list[int],
    chunk_bytes: int | None,
    links: dict[str, Any],
) -> tuple[DeviceTransfer, list[int], list[int], str | None]:
    """Clones under one sync (together with the tensors that do not fit), then the rest by bulk transfers here. The
    sync is only launched when everything fits: torch_xla runs the next step after it and fetches wait for it.
    ``links``: the transfer's ``aliases`` and ``deadline``. Returns the transfer, the indices cloned and moved here,
    and ``Snapshot.fallback``."""
    # one execution materialises the snapshot (launched, not waited for)
    clones, live, fallback = _launch_xla_copies_or_none(tensors, fit, rest, wait=bool(rest))
    if fallback is not None:  # out of memory: everything moves here, from the live tensors
        fit, rest = [], sorted(fit + rest)
        live = [tensors[i].detach() for i in rest]
    arrived: dict[int, torch.Tensor] = {}
    for batch, copies in xla.iter_to_cpu(live, chunk_bytes, synced=fallback is None):
        for j, c in zip(batch, copies, strict=True):
            arrived[id(keys[rest[j]])] = c
    del live
    transfer = _transfer([keys[i] for i in fit], clones, chunk_bytes, arrived, links | {"synced": True})
    return transfer, fit, rest, fallback


def _take_native(
    native: NativeDevice,
    tensors: Sequence[torch.Tensor],
    keys: list[torch.Tensor],
    fit: list[int],
    rest: list[int],
    pool: PinnedPool | None,
    chunk_bytes: int | None,
    links: dict[str, Any],
) -> tuple[DeviceTransfer, list[int], list[int], str | None]:
    """Clones enqueued on the training stream (those the device has no memory for join the rest); the rest copied
    into pinned buffers on a side stream that the training stream waits for, all under ``native``'s device (the
    caller's thread may have another device current, or none set: device 0). Returns without waiting for the
    device: the transfer, the indices cloned and copied here, and ``Snapshot.fallback``. ``links``: the transfer's
    ``aliases`` and ``deadline``."""
    training = native.current_stream()
    clones, uncloned, fallback = _clone_while_memory_lasts(tensors, fit)
    if uncloned:
        fit, rest = fit[: len(clones)], sorted(rest + uncloned)
    # a process's first stream costs milliseconds (the backend fills its stream pool): made here only when the call
    # enqueues copies on it, else by the transfer thread
    side = native.new_stream() if rest else None
    arrived: dict[int, torch.Tensor] = {}
    lent: list[torch.Tensor] = []
    arrived_event = None
    if side is not None:
        side.wait_event(native.record(training))  # the copies see every update enqueued before the save
        try:
            with native.on(side), torch.no_grad():
                for i in rest:
                    buffer = (
                        pool.take(tensors[i], native.staging_empty)
                        if pool is not None
                        else native.staging_empty(tensors[i].shape, tensors[i].dtype)
                    )
                    buffer.copy_(tensors[i].detach(), non_blocking=True)
                    arrived[id(keys[i])] = buffer
                    lent.append(buffer)
        except BaseException:
            native.record(side).synchronize()  # staging buffers are only dropped once their copies are done
            raise
        arrived_event = native.record(side)
        training.wait_event(arrived_event)  # training's next kernels cannot overwrite what is still being copied
    ready = native.record(training)  # the clones are enqueued before this point
    device = {"arrived_event": arrived_event, "native": native, "ready": ready, "side": side, "pool": pool}
    transfer = _transfer([keys[i] for i in fit], clones, chunk_bytes, arrived, links | device | {"lent": lent})
    return transfer, fit, rest, fallback


def _transfer(
    keys: list[torch.Tensor],
    clones: list[torch.Tensor],
    chunk_bytes: int | None,
    arrived: dict[int, torch.Tensor],
    extra: dict[str, Any],
) -> DeviceTransfer:
    """The background transfer of a snapshot's ``clones`` (stand-ins ``keys``), with the host copies the call
    made itself (``arrived``) and the device kind's ``extra`` fields (the links, streams, events, pools)."""
    return DeviceTransfer(keys, clones, chunk_bytes=chunk_bytes, background=True, arrived=arrived, **extra)
