"""Advice to the kernel about host memory pages (``madvise``): the one module of nxd_ckpt that gives it.

Fresh memory costs a page fault for every 4 KiB page written first (about 0.3 s per GB on the VMs measured, as
much as the copy itself). ``populate`` takes a range's pages in one call (``MADV_POPULATE_WRITE``, Linux 5.14+;
it never changes a byte, so it may run over pages another thread is filling), and ``Prefaulter`` does that on a
daemon thread ahead of whoever fills the memory: a load reading into fresh tensors, a first async save's staging
copy, or ``prepare_async_save`` beside the training loop. Where the kernel lacks the call, nothing is done and
the writer takes the faults itself. ``drop`` releases the pages of a file mapping; ``private_buffer`` and
``discard`` give a budgeted copy memory of its own that goes back to the kernel the moment its file is written.
``lock`` keeps a range's pages in memory (a load's checked pages of a file, used later without a second check).
``huge_buffer`` gives a large scratch buffer in 2 MiB pages where the kernel allows it (a load holding its bytes
until they are checked: 512 times fewer faults than 4 KiB pages, measured 2x the speed of reading into them).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
_CHUNK = 8 << 20
"""Bytes populated per call: small enough that ``close`` stops the thread within a few milliseconds."""
MIN_BYTES = 1 << 20
"""Tensors smaller than this are left to their writer (a call per tensor would cost more than it saves)."""

_log = logging.getLogger(__name__)
_supported: bool | None = None


@functools.cache
def _libc() -> Any:
    """The C library's ``madvise`` and ``mlock`` (Linux), typed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.restype = ctypes.c_int
    return libc


def _libc_madvise() -> Any:
    """``madvise``, or False off Linux."""
    return _libc().madvise if sys.platform.startswith("linux") else False


def _whole_pages(start: int, end: int) -> tuple[int, int]:
    """The start and end of the whole pages inside [start, end) (end <= start when there are none)."""
    return (start + PAGE - 1) // PAGE * PAGE, end // PAGE * PAGE


def populate(start: int, end: int) -> bool:
    """Fault in the whole pages inside [start, end) for writing; False when the kernel does not support it."""
    global _supported
    first, last = _whole_pages(start, end)
    if last <= first or _supported is False:
        return _supported is not False
    madvise = _libc_madvise()
    if not madvise or madvise(first, last - first, _MADV_POPULATE_WRITE) != 0:
        if _supported is None:
            _log.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d): memory is not pre-faulted", ctypes.get_errno())
        _supported = False
        return False
    _supported = True
    return True


def known_unsupported() -> bool:
    """Whether a ``populate`` already failed in this process (pre-faulting is then skipped)."""
    return _supported is False


def pieces(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """The whole pages inside [start, end) as consecutive ranges of at most ``size`` bytes (``size`` a multiple
    of the page), so that populating them piece by piece leaves no page out at a piece's edge."""
    first, last = _whole_pages(start, end)
    return [(at, min(at + size, last)) for at in range(first, last, size)]


def drop(start: int, end: int) -> None:
    """Release the pages touching [start, end) (MADV_DONTNEED). Only for *file* mappings: their pages are read
    again from the file if touched (dirty pages of a shared mapping stay in the page cache and are written back);
    anonymous memory would read back as zeroes."""
    madvise = _libc_madvise()
    if madvise and end > start:
        first = start // PAGE * PAGE
        madvise(first, (end + PAGE - 1) // PAGE * PAGE - first, _MADV_DONTNEED)


def private_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory in a mapping of its own (page-aligned, not from the C heap, not
    shared memory), for ``discard`` to give back while Python objects may still refer to it."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


HUGE_PAGE = 2 << 20


def huge_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh private anonymous memory as a uint8 array, in transparent huge pages where the kernel
    grants them (``MADV_HUGEPAGE``: Linux with THP in ``madvise`` or ``always`` mode), else ordinary pages. The
    mapping is returned to the kernel when the array (and every view of it) is gone. Small buffers come from the
    C heap (a mapping of their own would cost more than it saves)."""
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = np.frombuffer(mapping, dtype=np.uint8)  # holds the mapping until the last view is gone
    madvise = _libc_madvise()
    if madvise:
        start = buffer.__array_interface__["data"][0]
        first, last = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, (start + nbytes) // HUGE_PAGE * HUGE_PAGE
        if last > first and madvise(first, last - first, _MADV_HUGEPAGE) != 0:
            _log.debug("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KiB pages", ctypes.get_errno())
    return buffer


_lock_refused = False


def lock(start: int, end: int) -> bool:
    """Keep the pages touching [start, end) in memory (``mlock``: faulted in now, never reclaimed until they
    are unlocked or unmapped); False when the kernel refuses (``RLIMIT_MEMLOCK``, no memory), said once."""
    global _lock_refused
    if not sys.platform.startswith("linux") or end <= start:
        return False
    libc = _libc()
    first = start // PAGE * PAGE
    if libc.mlock(first, (end + PAGE - 1) // PAGE * PAGE - first) == 0:
        return True
    if not _lock_refused:
        _lock_refused = True
        _log.debug("mlock refused (errno %d): pages are not kept in memory", ctypes.get_errno())
    return False


def discard(start: int, end: int) -> None:
    """Give the whole pages inside [start, end) of *private anonymous* memory back to the kernel now
    (MADV_DONTNEED): for memory nobody reads again, which would read back as zeroes. Used where the last
    reference to a buffer may outlive its use by a while (a writer's frame after its file is closed)."""
    first, last = _whole_pages(start, end)
    madvise = _libc_madvise()
    if madvise and last > first:
        madvise(first, last - first, _MADV_DONTNEED)


class Prefaulter:
    """Populates the pages of ``tensors`` (CPU, in the order they will be filled) on one daemon thread; with
    ``low_priority`` the thread runs at nice 19 (beside a training loop, on an otherwise idle core)."""

    def __init__(self, tensors: Sequence[torch.Tensor], low_priority: bool = False) -> None:
        self._ranges = [
            (t.data_ptr(), t.numel() * t.element_size())
            for t in tensors
            if t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES
        ]
        self._low_priority = low_priority
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._ranges and not known_unsupported() and _libc_madvise():
            self._thread = threading.Thread(target=self._run, name="nxd_ckpt_prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self._low_priority:
            with contextlib.suppress(OSError, AttributeError):  # best effort
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            for start, length in self._ranges:  # whole pages: the edges are left to the writer
                for lo, hi in pieces(start, start + length, _CHUNK):
                    if self._stop.is_set() or not populate(lo, hi):
                        return
        except Exception:  # an optimisation only: the writer faults the pages itself
            _log.debug("pre-faulting stopped", exc_info=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every page is in (waits up to ``timeout`` s)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Stop (within one chunk) and wait for the thread: the tensors may be freed once this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


@contextlib.contextmanager
def prefaulted(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Pre-fault ``tensors`` while the body fills them; the thread has stopped when the body exits."""
    prefaulter = Prefaulter(tensors)
    try:
        yield
    finally:
        prefaulter.close()
