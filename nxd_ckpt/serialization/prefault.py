"""Faulting in the pages of freshly allocated tensors on a background thread, ahead of the reader filling them.

A load into fresh memory pays a page fault for every 4 KiB page it writes first (about 0.3 s per GB on the
VMs measured, as much as the copy itself), and ``torch.load`` pays it on the reading thread. Here a daemon
thread asks the kernel to populate the pages (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+) while the reader
waits for the disk. Populating never changes a byte (a page already present is left alone), so it may run
over pages the reader is filling at the same time. Where the kernel lacks the call, nothing is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_CHUNK = 8 << 20
"""Bytes populated per call: small enough that ``close`` stops the thread within a few milliseconds."""
MIN_BYTES = 1 << 20
"""Tensors smaller than this are left to the reader (a call per tensor would cost more than it saves)."""

_log = logging.getLogger(__name__)
_supported: bool | None = None
_madvise = None


def _libc_madvise():  # type: ignore[no-untyped-def]
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def _populate(start: int, length: int) -> bool:
    """Populate the whole pages of [start, start + length); False when the kernel does not support it."""
    global _supported
    first = (start + _PAGE - 1) // _PAGE * _PAGE
    end = (start + length) // _PAGE * _PAGE
    if end <= first:
        return True
    if _libc_madvise()(first, end - first, _MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        if _supported is None:
            _log.debug("madvise(MADV_POPULATE_WRITE) failed (errno %d): fresh tensors are not pre-faulted", errno)
        _supported = False
        return False
    _supported = True
    return True


class Prefaulter:
    """Populates the pages of ``tensors`` (CPU, in the order the reader fills them) on one daemon thread."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._ranges = [
            (t.data_ptr(), t.numel() * t.element_size())
            for t in tensors
            if t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES
        ]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._ranges and _supported is not False:
            self._thread = threading.Thread(target=self._run, name="nxd_ckpt_prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for start, length in self._ranges:
                first = (start + _PAGE - 1) // _PAGE * _PAGE  # whole pages: the edges are left to the reader
                end = (start + length) // _PAGE * _PAGE
                for at in range(first, end, _CHUNK):
                    if self._stop.is_set() or not _populate(at, min(_CHUNK, end - at)):
                        return
        except Exception:  # an optimisation only: the reader faults the pages itself
            _log.debug("pre-faulting fresh tensors stopped", exc_info=True)

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
