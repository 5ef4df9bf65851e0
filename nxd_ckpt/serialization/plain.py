"""Plain ``torch.save`` encoding and safe loading of CPU state.

Loading is ``torch.load(weights_only=True)`` with a small allow-list by default, so no code stored in a
checkpoint runs; ``trusted=True`` is the explicit opt-in for files holding arbitrary pickled classes.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable
from typing import IO, Any

import numpy as np
import torch
import torch._weights_only_unpickler

from ..errors import FormatError, UnsafeCheckpointError
from . import inmemory

_extra_safe_globals: list[Any] = []


def register_safe_globals(objs: Iterable[Any]) -> None:
    """Allow more classes in safe loading (for format classes such as xser's TensorReference)."""
    for obj in objs:
        if obj not in _extra_safe_globals:
            _extra_safe_globals.append(obj)


def safe_globals() -> list[Any]:
    """The classes safe loading allows beyond torch's defaults (for readers that unpickle themselves)."""
    return list(_extra_safe_globals)


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
    try:
        if trusted:
            return torch.load(f, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(list(_extra_safe_globals)):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if trusted or ("weights_only" not in str(e) and "Unsupported global" not in str(e)):
            raise FormatError(f"{what} is not a readable torch.save file: {_first_line(e)}") from e
        name = _unsafe_names(f, str(e))
        raise UnsafeCheckpointError(
            f"{what} holds a pickled {name}, which is not on the safe-loading allow-list; loading it would run code "
            "from the checkpoint. If you trust this checkpoint, pass allow_pickle=True to load_checkpoint (or "
            "trusted=True to the reader)."
        ) from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise FormatError(f"{what} is truncated or not a torch.save file: {_first_line(e)}") from e


def load_buffer(buffer: np.ndarray, *, what: str, trusted: bool = False) -> Any:
    """``load`` of a file held in memory (``Storage.read_buffer``); its tensors share ``buffer`` (no copy).

    Safe loading unpickles with torch's weights-only unpickler and the same allow-list as ``load``; trusted
    files, unusual layouts and every error go through ``load`` over the buffer, which words the error.
    """
    if not trusted:
        try:
            with torch.serialization.safe_globals(list(_extra_safe_globals)):
                return inmemory.load_zero_copy(buffer, what, _weights_only_unpickler)
        except Exception:  # torch.load below gives the proper error, or handles what this reader does not
            pass
    return load(inmemory.BufferReader(buffer), what=what, trusted=trusted)


def _weights_only_unpickler(data: io.BytesIO) -> Any:
    return torch._weights_only_unpickler.Unpickler(data, encoding="utf-8")


def _unsafe_names(f: IO[bytes], message: str) -> str:
    """The names of the globals the file's pickle imports that safe loading refuses, read without running it."""
    from .pickle_scan import allowed_globals, scan_torch_file

    try:
        f.seek(0)
        names = sorted(scan_torch_file(f, check_crc=False) - allowed_globals())
    except Exception:  # a damaged file: fall back to what torch's message says
        names = []
    if names:
        return ", ".join(names)
    found = re.search(r"GLOBAL ([\w.]+)", message)
    return found.group(1) if found else "object that is not a tensor or plain Python value"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
