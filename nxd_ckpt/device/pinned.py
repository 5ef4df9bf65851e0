"""Page-locked host buffers for native accelerators, kept across saves.

A device -> host copy into pageable memory runs at a fraction of the bus speed and cannot overlap anything; into
page-locked (pinned) memory it is asynchronous and fast, but pinning is expensive (the first save of a process
would pay it). So the pool keeps the buffers of the last save, matched by shape and dtype, and hands them to the
next one; ``prepare`` reserves them ahead (``prepare_async_save``), and ``clear`` (``finalize_checkpoint``) frees
them. Host memory stays one copy of what the rank saves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

Key = tuple[tuple[int, ...], torch.dtype]


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
