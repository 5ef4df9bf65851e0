"""Which pages of a tensor are in memory (``mincore``): tests check pre-faulting and pages given back with it."""

from __future__ import annotations

import ctypes
import mmap

import torch

_PAGE = mmap.PAGESIZE


class MincoreUnavailable(RuntimeError):
    """The kernel refused ``mincore`` for this range."""


def resident_fraction(t: torch.Tensor) -> float:
    """The fraction of ``t``'s whole pages that are in memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = (t.data_ptr() + _PAGE - 1) // _PAGE * _PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
    count = (end - start) // _PAGE
    if count <= 0:
        raise ValueError(f"a tensor of {t.numel() * t.element_size()} bytes holds no whole page")
    vec = ctypes.create_string_buffer(count)
    if libc.mincore(start, end - start, vec) != 0:
        raise MincoreUnavailable(f"mincore failed (errno {ctypes.get_errno()})")
    return sum(b & 1 for b in vec.raw) / count
