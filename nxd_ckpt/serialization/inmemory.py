"""Parsing ``torch.save`` files that are already in memory, with tensors sharing that memory (no second copy).

Loads read each file from storage once into one buffer (``Storage.read_buffer(path, allocate)``), hash it there
when it is verified, and parse it from the same memory: ``BufferReader`` gives torch's zip reader a stream over the
buffer, and ``load_zero_copy`` builds every tensor on a slice of it (``torch.frombuffer``). ``torch.save`` aligns
its data records to 64 bytes, so the slices are aligned for every dtype; a misaligned record is copied instead.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import numpy as np
import torch

from nxd_ckpt.errors import FormatError
from nxd_ckpt.serialization import torchzip
from nxd_ckpt.storage.base import SeekableReader


def allocate(size: int) -> np.ndarray:
    """An uninitialised uint8 array from torch's allocator, for ``Storage.read_buffer`` (numpy's own asks for
    huge pages, which made parallel 16 MiB tensor-file reads about 25% slower on our VMs)."""
    return torch.empty(size, dtype=torch.uint8).numpy()  # the array keeps the tensor (its memory) alive


class BufferReader(SeekableReader, io.RawIOBase):
    """A read-only, seekable binary stream over a buffer: ``readinto`` copies straight from it, nothing else."""

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._view = memoryview(buffer).cast("B")
        self._pos = 0

    def readinto(self, b: Any) -> int:
        dest = memoryview(b).cast("B")
        n = max(0, min(len(dest), len(self._view) - self._pos))
        dest[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def _size(self) -> int:
        return len(self._view)


def load_zero_copy(buffer: np.ndarray, what: str) -> Any:
    """Safely unpickle a ``torch.save`` zip held in ``buffer`` with its storages as CPU views of ``buffer``
    (``torchzip``'s reader, allow-listed classes only).

    Raises FormatError for a damaged or truncated file; other exceptions mean a layout this reader does not
    handle (callers fall back to torch.load, which words them).
    """
    reader, pickled = torchzip.open_zip(BufferReader(buffer), what)
    if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")).decode() != sys.byteorder:
        raise NotImplementedError("byte-swapped file")  # torch.load swaps it

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        element = torch._utils._element_size(dtype)
        untyped = _storage_view(buffer, reader.get_record_offset(f"data/{key}"), nbytes, element)
        if untyped is None:
            raise FormatError(f"{what} is truncated: tensor data record data/{key} runs past the end of the file")
        return untyped

    return torchzip.load_records(pickled, source, what=what, trusted=False, word_errors=False)


def _storage_view(buffer: np.ndarray, offset: int, nbytes: int, element: int) -> torch.UntypedStorage | None:
    """``nbytes`` of ``buffer`` from ``offset`` as a storage sharing its memory (copied when misaligned)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    if offset < 0 or offset + nbytes > buffer.nbytes:
        return None
    view = torch.frombuffer(buffer[offset : offset + nbytes], dtype=torch.uint8)  # keeps ``buffer`` alive
    if view.data_ptr() % element:
        view = view.clone()
    return view.untyped_storage()
