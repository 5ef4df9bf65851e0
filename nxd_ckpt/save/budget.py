"""Async saves under a host memory budget: the state is staged, and written, in pieces no larger than the budget.

An async save normally copies the whole state into host buffers (``staging.StagingPool``) and returns: host memory
grows by one full copy of the rank's state. With a budget (``host_memory_budget=`` or
``NXD_CKPT_HOST_MEMORY_BUDGET``) a ``BudgetedStager`` takes its place. The writer starts at once and the training
thread, still inside the save call, copies tensors into host memory in the order the writers need them, as long
as the copies held stay within the budget; each copy is freed as soon as the file holding it is written (the
stager ``watch``-es the save's storage for closed files). When the writer reaches a tensor nobody has copied yet
it writes it straight from the live tensor: the training thread is still blocked in the save, so the tensor
cannot change, and the save returns only once every such file is written (``stage`` waits for them). So the
training thread waits for whatever does not fit, no more copies exist than the budget allows (a tensor larger
than the budget is never copied at all), and the rest of the save continues in the background after the call
returns, from the copies.

Tensors of 1 MiB or less that the writer asks for before they are copied are copied by the writer itself when
they fit (a plain file's small tensors, xser tensors kept inline), so that the call need not wait for their files;
they count toward the budget like the others. Copies fetched outside any file (xser's inline tensors, taken when
the reference data is built) are freed when the writer ends.

Device state comes as *frozen* tensors: copies on the device (a snapshot the call took) that nothing changes. The call
does not stage them; ``stage_frozen``, on the transfer thread, brings them to the host in the writers' order, in batches
that fit the budget (``fetch``: bulk transfers, or copies into a pinned arena whose pieces ``give_back`` returns once
their files are written; ``room`` says whether the arena's free runs hold a batch, which they may not where the budget
would, and the copies wait for them rather than land in pageable memory). A writer waits for the frozen tensor it needs,
unless ``stage_frozen`` waits for room that the writer's own file holds (or has waited ``STUCK_S``): the writer then
copies it itself, beyond the budget (``overdrawn_bytes``), rather than stall the save.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import torch

from nxd_ckpt import pages
from nxd_ckpt.ranks.deadlines import Deadline
from nxd_ckpt.storage import DelegatingStorage, Storage

STUCK_S = 1.0
"""How long writers wait for frozen copies while ``stage_frozen`` waits for room, before copying themselves."""
SMALL_BYTES = 1 << 20
"""Tensors up to this size that the writer needs before they are staged are copied by the writer itself."""

FROZEN_PHASE = "bringing device copies to the host under the host memory budget"
"""The phase a wait for the device copies of a budgeted save that passed its deadline names."""

_PENDING, _COPYING, _STAGED, _BORROWED, _DONE = range(5)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_OWN_MAPPING_BYTES = 1 << 20
"""Copies from this size up get a mapping of their own (see ``_copy``)."""


def _copy(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A host copy of ``t`` that owns its memory (dense CPU tensors into a fresh buffer, others cloned), and
    whether that memory is a mapping of its own.

    A copy of 1 MiB or more gets private anonymous memory of its own, which the stager gives back to the kernel
    (``pages.discard``) as soon as its file is written: through the C heap, copies made on one thread and freed
    on another stayed resident in the heap's free lists (under torch 2.9: 1-4 freed 16 MiB copies beyond the
    budget), and even in mappings of their own, copies lived on in the writer's frames for tens of milliseconds
    after their files were closed, long enough for the next copies to be made (under torch 2.9, xser: budget +
    33-65 MiB resident)."""
    if t.device.type != "cpu":
        return t.detach().to("cpu"), False
    if t.layout != torch.strided or t.is_quantized:
        return t.detach().clone(), False
    n = _nbytes(t)
    mapped = n >= _OWN_MAPPING_BYTES
    if mapped:
        out = torch.frombuffer(pages.private_buffer(n), dtype=t.dtype, count=t.numel()).view(t.shape)
    else:
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    with torch.no_grad():
        out.copy_(t.detach())
    return out, mapped


class BudgetedStager:
    """Host copies of an async save's tensors that never hold more than ``budget`` bytes at once.

    Used from four places: ``stage`` on the training thread (inside the save call), ``stage_frozen`` on the transfer
    thread (device copies, ``frozen``), ``host`` on the writer's threads (the ``HostCopy`` every state-file writer
    takes), and the storages given to ``watch`` (a closed file frees the copies its writer thread fetched). ``close``
    (the writer's end) frees everything and wakes ``stage`` and ``stage_frozen``. Each of their waits lasts at most
    ``timeout_s`` and then raises ``CheckpointTimeoutError`` naming ``rank`` (``stage_frozen`` keeps it for the
    writers).
    """

    def __init__(
        self,
        order: Sequence[torch.Tensor],
        budget: int,
        timeout_s: float | None = None,
        frozen: Mapping[int, torch.Tensor] | None = None,
        fetch: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
        batch_bytes: int | None = None,
        give_back: Callable[[torch.Tensor], None] | None = None,
        room: Callable[[Sequence[int]], int] | None = None,
        rank: int | None = None,
    ) -> None:
        if budget < 1:
            raise ValueError(f"the host memory budget must be a positive number of bytes, got {budget}")
        self.budget = budget
        self.timeout_s = timeout_s
        self.deadline = Deadline(timeout_s, rank) if timeout_s is not None else Deadline.default()
        self._order = list({id(t): t for t in order}.values())
        self._frozen: dict[int, torch.Tensor] = dict(frozen or {})
        """Key -> a copy of its tensor that nothing changes (a device snapshot): staged beside training by
        ``stage_frozen``, not by the call."""
        self._sharing: dict[int, list[torch.Tensor]] = {}
        """``id`` of a device copy -> the tensors it is the copy of (several for tied weights)."""
        for t in self._order:
            if id(t) in self._frozen:
                self._sharing.setdefault(id(self._frozen[id(t)]), []).append(t)
        self._fetch = fetch if fetch is not None else (lambda ts: [_copy(t)[0] for t in ts])
        self._give_back = give_back
        """Called with each host copy ``fetch`` made once nothing reads it any more (its pinned memory is reused)."""
        self._room = room
        """How many copies of these sizes (bytes, in order) ``fetch``'s memory holds now (a pinned arena's free runs,
        which may be split where the budget is not): ``stage_frozen`` waits for room in both. None: the budget's."""
        self._fetched_from_frozen: set[int] = set()
        self._frozen_beside = False
        """``stage_frozen`` will run or runs (``begin_frozen`` until it ends): writers wait for its copies."""
        self._stuck_since: float | None = None
        """Since when ``stage_frozen`` waits for room (None while it does not)."""
        self._frozen_progress = 0.0
        """When ``stage_frozen`` last showed progress (announced, stored a batch); ``_fetching`` while it copies."""
        self._fetching = False
        self._batch_bytes = batch_bytes if batch_bytes is not None else self.budget
        self._error: BaseException | None = None
        self._state: dict[int, int] = {id(t): _PENDING for t in self._order}
        self._copies: dict[int, torch.Tensor] = {}
        self._mapped: set[int] = set()
        """Keys whose copy is in a mapping of its own (given back to the kernel when its file is written)."""
        self._cond = threading.Condition()
        self._local = threading.local()
        self._closed = False
        self._abandoned: str | None = None
        self.held_bytes = 0
        """Bytes of copies held right now."""
        self.peak_bytes = 0
        """Most bytes of copies held at once during the save."""
        self.staged_bytes = 0
        """Bytes copied in all (each byte once)."""
        self.borrowed_bytes = 0
        """Bytes written straight from the live tensors while the training thread waited."""
        self.copied_by_writers_bytes = 0
        """Bytes of frozen tensors writers reached before ``stage_frozen`` and copied themselves (into ``fetch``'s
        memory as it was: a writer does not wait for room in a pinned arena)."""
        self.overdrawn_bytes = 0
        """The part of ``copied_by_writers_bytes`` beyond the budget."""
        self.waited_s = 0.0
        """Time ``stage`` spent waiting for the writer (memory to be freed, live tensors to be written)."""

    # ------------------------------------------------------------------ the training thread
    def stage(self) -> None:
        """Copy every tensor the writer has not taken yet, within the budget; return once no file still needs a
        live tensor. Raises CheckpointTimeoutError after ``timeout_s`` of waiting (the save then fails)."""
        start = time.monotonic()
        for t in self._order:
            key, n = id(t), _nbytes(t)
            if key in self._frozen:
                continue  # copied beside training (stage_frozen)
            with self._cond:
                waited = time.monotonic()
                self._wait(lambda k=key, n=n: self._state[k] != _PENDING or self.held_bytes + n <= self.budget, start)
                self.waited_s += time.monotonic() - waited
                if self._state[key] != _PENDING or n > self.budget:
                    continue  # taken by the writer meanwhile, or never copied (written from the live tensor)
                self._reserve(key, n)
            copy, mapped = _copy(t)
            with self._cond:
                self._stored(t, copy, mapped)
        live = [id(t) for t in self._order if id(t) not in self._frozen]
        with self._cond:
            waited = time.monotonic()
            self._wait(lambda: not any(self._state[k] in (_PENDING, _COPYING, _BORROWED) for k in live), start)
            self.waited_s += time.monotonic() - waited

    def begin_frozen(self) -> None:
        """``stage_frozen`` is about to be started: a writer waits for its copies (unless it waits for room)."""
        with self._cond:
            self._frozen_beside = bool(self._frozen)
            self._frozen_progress = time.monotonic()

    def stage_frozen(self) -> None:
        """(A background thread.) Copy the frozen tensors in the writers' order, in batches of at most
        ``batch_bytes`` that fit the budget, waiting for room while the writer runs. One larger than the budget is
        left to the writer. Keeps its error for the writers (``host`` raises it)."""
        try:
            pending = [t for t in self._order if id(t) in self._frozen and _nbytes(t) <= self.budget]
            while True:
                with self._cond:
                    pending = [t for t in pending if self._state[id(t)] == _PENDING]  # not reached by a writer
                    if not pending:
                        return
                    first = pending[0]
                    self._wait_for_room(first)
                    if self._closed or self._abandoned is not None:
                        return
                    if self._state[id(first)] != _PENDING:
                        continue
                    limit, batch = min(self.budget - self.held_bytes, max(self._batch_bytes, _nbytes(first))), []
                    in_batch: set[int] = set()  # device copies fetched by this batch: their aliases get host clones
                    for t in pending:
                        if self._state[id(t)] != _PENDING or id(self._frozen[id(t)]) in in_batch:
                            continue
                        if _nbytes(t) > limit:
                            break
                        limit -= _nbytes(t)
                        batch.append(t)
                        in_batch.add(id(self._frozen[id(t)]))
                    if self._room is not None:  # the first fits: so many of the others as fit after it
                        del batch[max(1, self._room([_nbytes(t) for t in batch])) :]
                    for t in batch:
                        self._reserve(id(t), _nbytes(t))
                    sources = [self._frozen[id(t)] for t in batch]
                    self._fetching = True
                try:
                    copies = self._fetch(sources)
                finally:
                    del sources
                    with self._cond:
                        self._fetching = False
                        self._frozen_progress = time.monotonic()
                with self._cond:
                    for t, copy in zip(batch, copies, strict=True):
                        self._stored_frozen(t, copy)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            with self._cond:
                self._frozen_beside, self._stuck_since = False, None
                self._cond.notify_all()

    def _stored_frozen(self, t: torch.Tensor, copy: torch.Tensor) -> None:
        """(Under the lock, ``stage_frozen``.) ``copy`` fetched from ``t``'s device copy is staged; the tensors that
        share that device copy (tied weights) and still wait get a host clone of it, without another transfer (each
        key keeps a copy of its own: the files hold one tensor per key, as NxD writes them)."""
        source = self._frozen.pop(id(t), None)  # its device copy can go now
        self._stored(t, copy, False)
        self._fetched_from_frozen.add(id(t))
        for alias in self._sharing.get(id(source), ()) if source is not None else ():
            if alias is not t and id(alias) in self._frozen and self._state[id(alias)] == _PENDING:
                self._frozen.pop(id(alias))
                self._reserve(id(alias), _nbytes(alias))
                self._stored(alias, copy.clone(), False)
                self._fetched_from_frozen.add(id(alias))

    def _wait_for_room(self, first: torch.Tensor) -> None:
        """(Under the lock, ``stage_frozen``.) Wait until ``first`` fits, a writer took it, or the writer ended;
        past the deadline raise (writers then get the error)."""
        if not self._has_room(first):
            self._stuck_since = time.monotonic()
            self._cond.notify_all()  # a writer that holds room of its own copies what it needs itself
        self.deadline.wait(
            self._cond,
            lambda: (
                self._closed
                or self._abandoned is not None
                or self._state[id(first)] != _PENDING
                or self._has_room(first)
            ),
            FROZEN_PHASE,
            "the writer to free room for the device copies",
        )
        self._stuck_since = None

    def _has_room(self, t: torch.Tensor) -> bool:
        """(Under the lock.) Whether ``stage_frozen`` can copy ``t`` now: within the budget, into ``fetch``'s memory."""
        n = _nbytes(t)
        return self.held_bytes + n <= self.budget and (self._room is None or self._room([n]) == 1)

    def _wait(self, ready: Any, start: float) -> None:
        """(Under the lock.) Wait until ``ready()``, the writer has ended, or the deadline has passed."""
        while not ready() and not self._closed:
            left = None if self.timeout_s is None else self.timeout_s - (time.monotonic() - start)
            if left is not None and left <= 0:
                self._abandoned = f"the save call gave up after {self.timeout_s:g} s waiting for the writer"
                self._cond.notify_all()
                raise self.deadline.expired(
                    "staging under the host memory budget",
                    f"the writer to free memory of a budget of {self.budget} bytes (or raise the budget)",
                )
            self._cond.wait(left if left is not None else 1.0)

    def _reserve(self, key: int, n: int) -> None:
        """(Under the lock.) ``n`` bytes of the budget for a copy about to be made (counted before it exists, so
        two threads copying at once cannot both fit into the same room)."""
        self._state[key] = _COPYING
        self.held_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _stored(self, t: torch.Tensor, copy: torch.Tensor, mapped: bool) -> None:
        """(Under the lock.) ``copy`` is ``t``'s staged copy now (in a mapping of its own if ``mapped``)."""
        self._copies[id(t)] = copy
        if mapped:
            self._mapped.add(id(t))
        self._state[id(t)] = _STAGED
        self.staged_bytes += _nbytes(t)
        self._cond.notify_all()

    # ------------------------------------------------------------------ the writer's threads
    def host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the writer reads for ``t``: its staged copy, else (small ones that fit) a copy made now,
        else the live tensor itself (the save call holds training until the file is written)."""
        key = id(t)
        with self._cond:
            if self._abandoned is not None:
                raise RuntimeError(f"this save was abandoned: {self._abandoned}")
            state = self._state.get(key)
            if state is None:  # not planned (should not happen): a private copy, outside the budget
                return _copy(t)[0]
            waited = time.monotonic()
            while self._waits_for(key, t):
                if time.monotonic() - waited > self.deadline.timeout_s:
                    raise self.deadline.expired(FROZEN_PHASE, f"the host copy of a {tuple(t.shape)} tensor")
                self._cond.wait(STUCK_S / 4)
            state = self._state[key]
            if self._error is not None and state != _STAGED:
                raise RuntimeError(f"copying the state to the host failed: {self._error}") from self._error
            self._fetched().append(t)
            if state == _STAGED:
                return self._copies[key]
            frozen = self._frozen.get(key) if state == _PENDING else None
            if frozen is not None:  # ahead of stage_frozen: copied here, even beyond the budget
                self._reserve(key, _nbytes(t))
                self.copied_by_writers_bytes += _nbytes(t)
                if self.held_bytes > self.budget:
                    self.overdrawn_bytes += _nbytes(t)
            elif state == _PENDING and _nbytes(t) <= SMALL_BYTES and self.held_bytes + _nbytes(t) <= self.budget:
                self._reserve(key, _nbytes(t))
            elif state == _PENDING:
                self._state[key] = _BORROWED
                self.borrowed_bytes += _nbytes(t)
                return t.detach()
            else:  # done: fetched again after its file was written (a tensor shared by two files)
                return self._copies.get(key, t.detach())
        from_frozen = frozen is not None
        copy, mapped = (self._fetch([frozen])[0], False) if frozen is not None else _copy(t)
        del frozen
        with self._cond:
            self._stored(t, copy, mapped)
            if from_frozen:
                self._fetched_from_frozen.add(key)
            self._frozen.pop(key, None)
        return copy

    def _waits_for(self, key: int, t: torch.Tensor) -> bool:
        """(Under the lock.) Whether a writer that needs ``t`` waits: while another thread copies it, or while
        ``stage_frozen`` is on its way to it. While that waits for room, a writer holding copies of its own (the
        file it writes holds room) copies ``t`` itself, and so does any writer once the wait has lasted
        ``STUCK_S``, or once ``stage_frozen`` has shown no progress for as long (not started: the transfer thread
        is busy elsewhere): the budget is overdrawn rather than the save stalled."""
        if self._error is not None or self._closed:
            return False
        state = self._state[key]
        if state == _COPYING:
            return True
        if state != _PENDING or key not in self._frozen or _nbytes(t) > self.budget or not self._frozen_beside:
            return False
        if self._stuck_since is not None:
            holds_room = any(self._state.get(id(f)) == _STAGED for f in self._fetched())
            return not holds_room and time.monotonic() - self._stuck_since < STUCK_S
        # on its way, unless it shows no progress (not started yet: the transfer thread is busy elsewhere)
        return self._fetching or time.monotonic() - self._frozen_progress < STUCK_S

    def _fetched(self) -> list[torch.Tensor]:
        fetched = getattr(self._local, "fetched", None)
        if fetched is None:
            fetched = self._local.fetched = []
        return fetched

    def file_written(self) -> None:
        """The calling writer thread closed a file: free the copies (and live tensors) it fetched for it."""
        fetched, self._local.fetched = self._fetched(), []
        freed: list[torch.Tensor] = []
        with self._cond:
            for t in fetched:
                copy = self._release(id(t), t)
                if copy is not None:
                    freed.append(copy)
            for copy in freed:  # before anyone waits on the budget: the pages are gone once it is counted free
                pages.discard(copy.data_ptr(), copy.data_ptr() + _nbytes(copy))
            self._cond.notify_all()
        if self._abandoned is not None:
            raise RuntimeError(f"this save was abandoned: {self._abandoned}")

    def _release(self, key: int, t: torch.Tensor) -> torch.Tensor | None:
        """(Under the lock.) ``t``'s file is written: its copy no longer counts. Returns the copy when it is in a
        mapping of its own, whose pages the caller gives back (nothing reads a copy once its file is closed: a
        later fetch of ``t`` gets the live tensor)."""
        state = self._state.get(key)
        copy = None
        if state == _STAGED:
            self.held_bytes -= _nbytes(t)
            copy = self._copies.pop(key, None)
            if copy is not None and key in self._fetched_from_frozen and self._give_back is not None:
                self._give_back(copy)
        if state in (_STAGED, _BORROWED):
            self._state[key] = _DONE
        return copy if copy is not None and key in self._mapped else None

    def watch(self, storage: Storage) -> None:
        """Free copies as ``storage``'s files are written: wraps the storage below ``storage`` (a checksumming
        storage, whose records and manifest stay where they are)."""
        inner = getattr(storage, "inner", None)
        if not isinstance(inner, Storage):
            raise TypeError(f"watch needs a wrapping storage (with .inner), got {type(storage).__name__}")
        storage.inner = _ReleasingStorage(inner, self)  # type: ignore[attr-defined]

    def close(self) -> None:
        """The writer is done (or failed): free every copy and let ``stage`` return."""
        with self._cond:
            self._closed = True
            if self._give_back is not None:
                for key in self._fetched_from_frozen & self._copies.keys():
                    self._give_back(self._copies[key])
            self._copies.clear()
            self._frozen.clear()
            self.held_bytes = 0
            self._cond.notify_all()


class _ReleasingStorage(DelegatingStorage):
    """Tells the stager when a writer thread has closed a file."""

    def __init__(self, inner: Storage, stager: BudgetedStager) -> None:
        super().__init__(inner)
        self._stager = stager

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        try:
            with self.inner.open_write(path) as f:
                yield f
        finally:
            self._stager.file_written()
