"""Plain ``torch.save`` encoding and safe loading of CPU state.

Loading is ``torch.load(weights_only=True)`` with a small allow-list by default, so no code stored in a
checkpoint runs; ``trusted=True`` is the explicit opt-in for files holding arbitrary pickled classes.
"""

from __future__ import annotations

from typing import IO, Any

import numpy as np
import torch
import torch._weights_only_unpickler

from nxd_ckpt.serialization import inmemory, torchzip
from nxd_ckpt.serialization.pickle_scan import scan_torch_file
from nxd_ckpt.serialization.torchzip import register_safe_globals

__all__ = ["load", "load_buffer", "register_safe_globals", "save"]


def save(obj: Any, f: IO[bytes]) -> None:
    """Write ``obj`` (CPU tensors and plain Python values) with ``torch.save``."""
    torch.save(obj, f)


def load(f: IO[bytes], *, what: str, trusted: bool = False) -> Any:
    """Read a ``torch.save`` file onto the CPU.

    Args:
        f: a readable, seekable binary stream.
        what: the file's name, used in error messages.
        trusted: allow arbitrary pickled objects (runs code from the file); off by default.
    """
    return torchzip.torch_load(f, what, trusted, name_unsafe=lambda msg: _unsafe_names(f, msg), map_location="cpu")


def load_buffer(buffer: np.ndarray, *, what: str, trusted: bool = False) -> Any:
    """``load`` of a file held in memory (``Storage.read_buffer``); its tensors share ``buffer`` (no copy).

    Safe loading unpickles with torch's weights-only unpickler and the same allow-list as ``load``; trusted
    files, unusual layouts and every error go through ``load`` over the buffer, which words the error.
    """
    if not trusted:
        try:
            return inmemory.load_zero_copy(buffer, what)
        except Exception:  # torch.load below gives the proper error, or handles what this reader does not
            pass
    return load(inmemory.BufferReader(buffer), what=what, trusted=trusted)


def _unsafe_names(f: IO[bytes], message: str) -> str:
    """The names of the globals the file's pickle imports that safe loading refuses, read without running it
    ("" when they cannot be read: torch's message names one)."""
    try:
        f.seek(0)
        return ", ".join(sorted(scan_torch_file(f, check_crc=False) - torchzip.allowed_global_names()))
    except Exception:  # a damaged file: fall back to what torch's message says
        return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
