"""Device -> host copies of a save's tensors, on a background thread, in byte-bounded chunks.

``DeviceTransfer`` serves the writers: ``host(key)`` blocks until that tensor's host copy has arrived, while the
thread moves the next chunk. XLA chunks go through torch_xla's bulk transfer (GIL released, copies in parallel);
a native accelerator's chunks are copied ``non_blocking`` on a side stream into pinned buffers from a
``PinnedPool``, each chunk waited for by an event, all with the sources' device current on the thread. A chunk's
sources (an async save's device snapshot) are dropped as soon as it is on the host, so the snapshot's device memory
shrinks as the transfer goes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nxd_ckpt import knobs, xla
from nxd_ckpt.device.backend import NativeDevice, kind, native_device, nbytes, on_device
from nxd_ckpt.device.pinned import PinnedPool
from nxd_ckpt.ranks.deadlines import Deadline
from nxd_ckpt.tree import iter_tensors, map_tensors

THREAD_NAME = "nxd_ckpt_d2h"
PHASE = "device-to-host transfer of the save's device state"
"""The phase a wait for a transfer that passed its deadline names."""
FIRST_CHUNK_BYTES = 32 << 20
"""The first chunk of a transfer, at most: the writers start on it while the next ones, each twice the one before
up to ``chunk_bytes``, travel. (XLA CPU device, 0.45 GB while training goes on: durable ~10% sooner than with
256 MiB chunks from the start, whose first took 0.15-0.25 s to arrive.)"""


class _TransferThread:
    """The process's one background transfer thread: it runs the transfers in the order they come, so a save
    starts no thread in its call (a thread's start there waited 1-7 ms behind the snapshot's own work on the XLA CPU
    device). Only one save stages at a time, so transfers do not wait for each other in practice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist there, and its lock or queue may have been in use
        at the fork; the next transfer starts a new thread with new ones."""
        self._lock = threading.Lock()
        self._jobs = queue.SimpleQueue()
        self._thread = None

    def start(self) -> None:
        """Start the thread unless it runs (a save calls this before it takes its snapshot)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread after the jobs before it; ``job`` must keep its own errors."""
        self.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            self._jobs.get()()


_THREAD = _TransferThread()
os.register_at_fork(after_in_child=_THREAD.reset_after_fork)


def start_transfer_thread() -> None:
    """Start the background transfer thread now, while the device is idle, rather than inside a save's call."""
    _THREAD.start()


def run_on_transfer_thread(job: Callable[[], None]) -> None:
    """Run ``job`` on the process's transfer thread, after the transfers queued before it (``job`` keeps its own
    errors)."""
    _THREAD.submit(job)


def has_device_tensors(tree: Any) -> bool:
    """Whether ``tree`` holds a tensor whose bytes live off the host."""
    return any(on_device(t) for _, t in iter_tensors(tree))


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor with ``t``'s shape, dtype and NxD's expert-parallel flag: what a writer plans with while
    ``t``'s bytes are elsewhere (on the device, or not this rank's to write)."""
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    if getattr(t, "expert_model_parallel", False):
        meta.expert_model_parallel = True  # type: ignore[attr-defined]
    return meta


def copy_to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (same order), now, on this thread: XLA ones with one sync and bulk transfers."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    xla_idx = [i for i, t in enumerate(tensors) if kind(t) == "xla"]
    if xla_idx:
        for i, c in zip(xla_idx, xla.to_cpu([tensors[i] for i in xla_idx]), strict=True):
            out[i] = c
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = t.detach().to("cpu")
    return out  # type: ignore[return-value]


def to_host(tree: Any, *, copy: bool) -> Any:
    """A copy of ``tree`` whose tensors are on the CPU; with ``copy`` CPU tensors are cloned too."""
    device_tensors = list({id(t): t for _, t in iter_tensors(tree) if on_device(t)}.values())
    host = dict(zip(map(id, device_tensors), copy_to_host(device_tensors), strict=True))

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) in host:
            return host[id(t)]
        return t.detach().clone() if copy else t.detach()

    return map_tensors(tree, convert)


class DeviceTransfer:
    """Host copies of device tensors, arriving on a background thread in chunks of at most ``chunk_bytes``.

    ``keys[i]`` is what writers ask ``host`` for (the live tensor in a synchronous save, a ``stand_in`` in an async
    one) and ``sources[i]`` the device tensor its bytes come from (the live tensor, or its snapshot on the device).
    ``arrived`` maps keys already copied by the caller to their host copies (valid once ``arrived_event``, a native
    device's event, has completed). A native device's copies wait for ``ready`` (an event recorded after the
    snapshot's clones) on ``side``, a stream of their own. ``background=False`` transfers everything now, on the
    caller's thread (``NXD_CKPT_XLA_TRANSFER_THREAD=0``). ``lent``: pinned buffers of ``pool`` that ``arrived``
    copies live in. ``aliases`` maps more keys (by id) to the key whose bytes they share (tied weights): moved once,
    each gets a host copy of its own. Every wait for the transfer (``host``, ``close``) lasts at most ``deadline``'s
    time (default: the library's) and then raises ``CheckpointTimeoutError``."""

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        *,
        chunk_bytes: int | None = None,
        background: bool | None = None,
        synced: bool = False,
        arrived: dict[int, torch.Tensor] | None = None,
        arrived_event: Any = None,
        native: NativeDevice | None = None,
        ready: Any = None,
        side: Any = None,
        pool: PinnedPool | None = None,
        lent: Sequence[torch.Tensor] = (),
        aliases: Mapping[int, torch.Tensor] | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        if len(keys) != len(sources):
            raise ValueError(f"{len(keys)} keys for {len(sources)} sources")
        self._keys = list(keys)
        self._sources: list[torch.Tensor | None] = list(sources)
        self._aliases = dict(aliases or {})
        self._planned = {id(k) for k in self._keys} | set(arrived or ()) | set(self._aliases)
        self.deadline = deadline if deadline is not None else Deadline.default()
        self._arrived = dict(arrived or {})
        self._arrived_event = arrived_event
        self._native = native if native is not None else native_device(list(sources))
        self._ready = ready
        self._side = side
        self._pool = pool
        self._generation = pool.generation if pool is not None else 0
        self._pinned: list[torch.Tensor] = list(lent)
        """Pinned buffers taken from ``pool`` (``lent``: those of ``arrived``), given back by ``close``."""
        self._chunk = chunk_bytes if chunk_bytes is not None else knobs.xla_transfer_batch_bytes()
        self.device_bytes_held = sum(nbytes(s) for s in sources)
        """Bytes of sources still referenced by this transfer (an async save's snapshot shrinks as it arrives)."""
        self.allocated_bytes = 0
        """Pinned host memory newly allocated by this transfer's thread (0 once the pool holds every buffer)."""
        self._copies: dict[int, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._reported = False
        self._done = False
        self._cond = threading.Condition()
        if self._native is not None and self._ready is None:  # the copies come after the caller's work so far
            with self._native.guard():
                self._ready = self._native.record(self._native.current_stream())
        xla_sources = [s for s in sources if kind(s) == "xla"]
        if xla_sources and not synced:
            xla.sync(xla_sources)  # one execution for all of them, on the caller's thread
        if background is None:
            background = knobs.xla_transfer_thread()
        if background:
            _THREAD.submit(self._run)
        else:
            self._run()
            self._raise_unreported()

    # ------------------------------------------------------------------ the transfer thread
    def _run(self) -> None:
        """The transfer, on the transfer thread; its error is kept for the writers and ``close``."""
        try:
            with self._native.guard() if self._native is not None else contextlib.nullcontext():
                self._move()  # under the sources' device: a thread starts on device 0
        except BaseException as e:  # raised in every writer waiting for a copy, and by close()
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _move(self) -> None:
        """Publish what the caller copied itself, then bring the rest over chunk by chunk."""
        if self._arrived:
            if self._arrived_event is not None:
                self._arrived_event.synchronize()
            with self._cond:
                self._copies.update(self._arrived)
                self._cond.notify_all()
            self._arrived.clear()
        for batch in self._batches():
            copies = self._copy_chunk([self._sources[i] for i in batch])  # type: ignore[misc]
            with self._cond:
                for i, c in zip(batch, copies, strict=True):
                    self._copies[id(self._keys[i])] = c
                    self.device_bytes_held -= nbytes(c)
                    self._sources[i] = None  # the snapshot's device memory of this chunk is free now
                self._cond.notify_all()

    def _batches(self) -> list[list[int]]:
        """Chunks in the given order, XLA ones apart, each at most ``chunk_bytes`` (or one larger tensor); the first
        of each kind at most ``FIRST_CHUNK_BYTES``, each next one at most twice the one before."""
        batches: list[list[int]] = []
        chunk = max(1, self._chunk)
        for xla_kind in (True, False):
            idx = [i for i, s in enumerate(self._sources) if s is not None and (kind(s) == "xla") == xla_kind]
            sizes = [nbytes(self._sources[i]) for i in idx]  # type: ignore[arg-type]
            batches += [[idx[j] for j in b] for b in xla.plan_batches(sizes, chunk, first=FIRST_CHUNK_BYTES)]
        return batches

    def _copy_chunk(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """One chunk on the host: a bulk transfer (XLA), non-blocking copies into pinned buffers (native), or plain
        copies (anything else, e.g. host tensors whose copy must outlive the caller's changes)."""
        if kind(sources[0]) == "xla":
            return xla.fetch(sources)
        native = self._native
        if native is None:
            return [s.detach().to("cpu") for s in sources]
        if self._side is None:  # made on this thread: a process's first stream costs milliseconds
            self._side = native.new_stream()
        if self._ready is not None:
            self._side.wait_event(self._ready)
            self._ready = None
        try:
            out = [self._pinned_like(s, native) for s in sources]
            with native.on(self._side), torch.no_grad():
                for buffer, s in zip(out, sources, strict=True):
                    buffer.copy_(s.detach(), non_blocking=True)
        finally:  # also after a failure: staging buffers are only dropped once their copies are done
            native.record(self._side).synchronize()
        return out

    def _pinned_like(self, like: torch.Tensor, native: NativeDevice) -> torch.Tensor:
        if self._pool is None:
            buffer = native.staging_empty(like.shape, like.dtype)
            self.allocated_bytes += nbytes(buffer)
        else:
            before = self._pool.allocated_bytes
            buffer = self._pool.take(like, native.staging_empty)
            self.allocated_bytes += self._pool.allocated_bytes - before
        self._pinned.append(buffer)
        return buffer

    # ------------------------------------------------------------------ the writers
    def host(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s host copy, once it has arrived; host and unplanned ``meta`` tensors as they are."""
        primary = self._aliases.get(id(t))
        if primary is not None:
            return self._own_copy(t, self.host(primary))
        if id(t) not in self._planned:
            if not on_device(t):
                return t.detach()
            with self._cond:  # a device tensor nobody planned (not expected): copied now
                self.deadline.wait(self._cond, lambda: self._done, PHASE, "the transfer to end")
            return copy_to_host([t])[0]
        with self._cond:
            self.deadline.wait(
                self._cond,
                lambda: id(t) in self._copies or self._error is not None or self._done,
                PHASE,
                f"a {tuple(t.shape)} {t.dtype} tensor to reach the host",
            )
            if id(t) in self._copies:
                return self._copies[id(t)]
            if self._error is not None:
                self._reported = True
                raise RuntimeError(f"copying the state to the host failed: {self._error}") from self._error
            raise RuntimeError("internal error: a planned tensor never arrived on the host")

    def _own_copy(self, alias: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """The host copy of ``alias``: a copy, made once, of the one of the key whose bytes it shares (a file keeps
        a tensor of its own for each key, as it did when the alias was moved apart)."""
        with self._cond:
            made = self._copies.get(id(alias))
        if made is None:
            made = host.clone()
            with self._cond:
                made = self._copies.setdefault(id(alias), made)
        return made

    def _raise_unreported(self) -> None:
        if self._error is not None and not self._reported:
            error, self._error = self._error, None
            self._reported = True
            raise RuntimeError(f"copying the state to the host failed: {error}") from error

    def close(self) -> None:
        """Wait for the transfer to end, drop the copies (pinned ones back to their pool), raise an unseen error.
        Past the deadline it raises and keeps the pinned buffers from the pool (the stuck copies may still land)."""
        with self._cond:
            self.deadline.wait(self._cond, lambda: self._done, PHASE, "the transfer to end")
        self._copies.clear()
        self._sources = []
        pinned, self._pinned = self._pinned, []
        if self._pool is not None and pinned:
            self._pool.give_back(pinned, self._generation)
        self._raise_unreported()
