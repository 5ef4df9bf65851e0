"""Page-locked host buffers for native accelerators, kept across saves.

A device -> host copy into pageable memory runs at a fraction of the bus speed and cannot overlap anything; into
page-locked (pinned) memory it is asynchronous and fast, but pinning is expensive (the first save of a process
would pay it). So the pool keeps the buffers of the last save, matched by shape and dtype, and hands them to the
next one; ``prepare`` reserves them ahead (``prepare_async_save``), and ``clear`` (``finalize_checkpoint``) frees
them. Host memory stays one copy of what the rank saves. ``registered_empty`` makes page-locked memory by locking
pageable memory in place, which training can run beside (CUDA staging buffers: ``NativeDevice.staging_empty``), in
mappings of their own that a forked child does not inherit.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import torch

Key = tuple[tuple[int, ...], torch.dtype]
PAGE = mmap.PAGESIZE
REGISTER_MIN_BYTES = 1 << 20
"""Smaller buffers come from the backend's own pinned allocator: registering them costs two pages each."""


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library's ``mmap``, ``madvise`` and ``munmap``, typed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _map(length: int) -> int:
    """The address of ``length`` bytes of a private anonymous mapping of their own, marked ``MADV_DONTFORK``: a
    child forked later (a DataLoader's workers) neither copies nor shares them. Not Python's ``mmap.mmap``: its
    object unmaps the range when a forked child drops it, where the child may have mapped something else since."""
    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {length} bytes for a pinned staging buffer failed: {os.strerror(errno)}")
    dontfork = getattr(mmap, "MADV_DONTFORK", None)  # Linux
    if dontfork is not None and libc.madvise(address, length, dontfork) != 0:
        errno = ctypes.get_errno()
        libc.munmap(address, length)
        raise OSError(errno, f"madvise(MADV_DONTFORK) of a pinned staging buffer failed: {os.strerror(errno)}")
    return address


class _Registration:
    """Owns a registered mapping: once the last tensor over it is gone, unregisters the range, then unmaps it. In a
    forked child it does neither (the range is not mapped there, and the registration is the parent's)."""

    def __init__(self, address: int, length: int, unregister: Callable[[int], None]) -> None:
        self._address = address
        self._length = length
        self._unregister = unregister
        self._pid = os.getpid()
        self._getpid = os.getpid  # no module globals in __del__: they may be gone at interpreter shutdown
        self._munmap = _libc().munmap

    def __del__(self) -> None:
        if self._getpid() != self._pid:
            return
        try:  # noqa: SIM105 (no module globals, see above)
            self._unregister(self._address)
        except Exception:  # interpreter shutdown or a lost device: the memory is freed either way
            pass
        self._munmap(self._address, self._length)


def registered_empty(
    shape: Sequence[int],
    dtype: torch.dtype,
    register: Callable[[int, int], bool],
    unregister: Callable[[int], None],
) -> torch.Tensor | None:
    """Page-locked host memory made by locking pageable memory in place (CUDA: ``cudaHostRegister``), or None when
    ``register`` refuses. Measured on an H200 for 9.7 GB in 144 buffers: 1.4 s with training steps going on beside
    it, where ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``) took 3.8 s with no training step completing
    meanwhile, and rounded every size up to a power of two. Each buffer is a mapping of its own (``_map``: whole
    pages, never shared with another buffer or the heap, not inherited by a forked child), touched first on all
    cores; dropping the last tensor over it unregisters and unmaps it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return None
    length = -(-nbytes // PAGE) * PAGE
    address = _map(length)
    try:
        exporter = (ctypes.c_uint8 * length).from_address(address)
        torch.frombuffer(exporter, dtype=torch.uint8).fill_(0)
        registered = register(address, length)
    except BaseException:
        _libc().munmap(address, length)
        raise
    if not registered:
        _libc().munmap(address, length)
        return None
    exporter._registration = _Registration(address, length, unregister)  # type: ignore[attr-defined]
    flat = torch.frombuffer(exporter, dtype=torch.uint8, count=nbytes)  # keeps ``exporter`` alive
    return flat.view(dtype).view(tuple(shape))


def key_of(t: torch.Tensor) -> Key:
    return tuple(t.shape), t.dtype


class PinnedPool:
    """Pinned host buffers by (shape, dtype): ``take`` reuses a free one or allocates it, ``give_back`` keeps it for
    the next save. Thread-safe: the training thread and a save's transfer thread both take buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[Key, list[torch.Tensor]] = {}
        self._generation = 0
        self.allocated_bytes = 0
        """Bytes of pinned memory this pool allocated so far (a steady loop stops adding to it)."""

    def take(self, like: torch.Tensor, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> torch.Tensor:
        """A pinned buffer of ``like``'s shape and dtype (``allocate`` makes a new one when none is free)."""
        key = key_of(like)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        buffer = allocate(key[0], key[1])
        with self._lock:
            self.allocated_bytes += buffer.numel() * buffer.element_size()
        return buffer

    def give_back(self, buffers: Sequence[torch.Tensor], generation: int | None = None) -> None:
        """Keep ``buffers`` for later saves (dropped if the pool was cleared since ``generation``)."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            for b in buffers:
                self._free.setdefault(key_of(b), []).append(b)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def held_bytes(self) -> int:
        """Bytes of pinned memory waiting in the pool for the next save."""
        with self._lock:
            return sum(b.numel() * b.element_size() for bs in self._free.values() for b in bs)

    def reserve(
        self, tensors: Sequence[torch.Tensor], allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]
    ) -> int:
        """Allocate (pin) a buffer for every tensor not already covered by a free buffer; the bytes allocated."""
        wanted: dict[Key, int] = {}
        for t in tensors:
            wanted[key_of(t)] = wanted.get(key_of(t), 0) + 1
        new: list[torch.Tensor] = []
        with self._lock:
            missing = {k: n - len(self._free.get(k, ())) for k, n in wanted.items()}
        for key, n in missing.items():
            new += [allocate(key[0], key[1]) for _ in range(max(0, n))]
        nbytes = sum(b.numel() * b.element_size() for b in new)
        with self._lock:
            self.allocated_bytes += nbytes
            for b in new:
                self._free.setdefault(key_of(b), []).append(b)
        return nbytes

    def clear(self) -> None:
        """Free every pooled buffer; buffers lent out now are dropped when they come back."""
        with self._lock:
            self._free.clear()
            self._generation += 1


ALIGN = 256
"""Pieces of a ``PinnedArena`` start at multiples of this many bytes (any dtype's alignment, and DMA-friendly)."""


def _piece_size(nbytes: int) -> int:
    """Bytes a piece of ``nbytes`` occupies in a ``PinnedArena`` (a multiple of ``ALIGN``)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _carve(free: list[tuple[int, int]], size: int) -> int | None:
    """Take ``size`` bytes from the first of the sorted free runs ``free`` that holds them (in place); the start,
    or None when none does."""
    run = next((i for i, (start, end) in enumerate(free) if end - start >= size), None)
    if run is None:
        return None
    start, end = free[run]
    if end - start == size:
        del free[run]
    else:
        free[run] = (start + size, end)
    return start


class PinnedArena:
    """One page-locked host buffer of ``capacity`` bytes, carved into tensors and given back piece by piece: an async
    save under a host memory budget copies a native accelerator's snapshot into it, so its pinned memory is the budget,
    kept across saves. Pieces go back in about the order they were taken (the writers'), so the free space stays in few
    runs; ``take`` answers None when no run is large enough (the caller copies elsewhere), and ``placeable`` tells
    beforehand, so that a copier can wait for room instead. Allocated (pinned) on the first ``take``, on the thread that
    takes. Thread-safe."""

    def __init__(self, capacity: int, allocate: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._lock = threading.Lock()
        self._memory: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, capacity)]
        """Free runs (start, end), sorted and coalesced."""
        self._taken: dict[int, tuple[int, int]] = {}
        """``data_ptr`` of a piece lent out -> its run."""
        self.allocated_bytes = 0
        self.refused_bytes = 0
        """Bytes of the pieces ``take`` had no free run for (copied into pageable memory instead)."""

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A piece of ``like``'s shape and dtype (contiguous), or None when no free run holds it."""
        n = like.numel() * like.element_size()
        size = _piece_size(n)
        with self._lock:
            start = _carve(self._free, size)
            if start is None:
                self.refused_bytes += n
                return None
            if self._memory is None:
                self._memory = self._allocate((self.capacity,), torch.uint8)
                self.allocated_bytes = self.capacity
            piece = self._memory[start : start + n].view(like.dtype).view(like.shape)
            self._taken[piece.data_ptr()] = (start, start + size)
            return piece

    def placeable(self, sizes: Sequence[int]) -> int:
        """How many of ``sizes`` (bytes, in this order) ``take`` would place now, one after the other. A piece
        larger than the whole arena counts as placed: it never fits, so waiting for room would not help."""
        with self._lock:
            free = list(self._free)
        for i, n in enumerate(sizes):
            size = _piece_size(n)
            if size <= self.capacity and _carve(free, size) is None:
                return i
        return len(sizes)

    def give_back(self, piece: torch.Tensor) -> None:
        """Free ``piece`` (a tensor ``take`` returned) for later pieces."""
        with self._lock:
            run = self._taken.pop(piece.data_ptr(), None)
            if run is None:
                return
            self._free.append(run)
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, end in self._free:
                if merged and merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], end)
                else:
                    merged.append((start, end))
            self._free = merged

    @property
    def lent_bytes(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._taken.values())
