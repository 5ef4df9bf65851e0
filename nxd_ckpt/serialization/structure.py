"""The structure of a ``torch.save`` file without its tensor data, and safe loading with clear errors.

``load_structure`` replays a file's ``data.pkl`` with storages on the ``meta`` device, so only the zip directory
and the pickle are read (``torch.load(map_location="meta")`` still reads every record in torch < 2.10). Each
meta storage remembers its zip record (``RECORD_ATTR``), so a reader can fetch just the records it needs.
Both functions follow plain.load's rules: allow-listed classes only unless ``trusted``.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
import torch._weights_only_unpickler as _weights_only

from ..errors import FormatError, UnsafeCheckpointError
from . import plain

RECORD_ATTR = "_nxd_ckpt_record"
"""Attribute set on each meta storage: the name of the zip record (``data/<key>``'s key) holding its bytes."""


def load_structure(f: Any, what: str, trusted: bool = False) -> Any:
    """A torch.save file's structure with every tensor on the ``meta`` device (shape, dtype, no data).

    Only the zip directory and ``data.pkl`` are read: the pickle is replayed with storages that allocate
    nothing (torch.load(map_location="meta") reads every record in torch < 2.10). Same safety rules as
    loading: allow-listed classes only unless ``trusted``. Legacy (non-zip) files fall back to torch.load.
    """
    try:
        pickled = torch._C.PyTorchFileReader(f).get_record("data.pkl")
    except RuntimeError as e:
        f.seek(0)
        if f.read(1) != b"\x80":  # neither a zip nor a legacy torch.save pickle
            raise FormatError(f"{what} is truncated or not a torch.save file: {_first_line(e)}") from e
        f.seek(0)
        return torch_load(f, what, trusted, map_location="meta")

    def persistent_load(saved_id: Any) -> Any:
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "_dtype", None)
        dtype = dtype or storage_type.dtype  # _dtype: the legacy class's dtype without a deprecation warning
        storage = torch.UntypedStorage(int(numel) * torch.empty((), dtype=dtype).element_size(), device="meta")
        setattr(storage, RECORD_ATTR, str(key))  # which zip record holds the data, for ranged reads
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def replay() -> Any:
        if trusted:
            unpickler: Any = pickle.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        else:
            unpickler = _weights_only.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        return unpickler.load()

    return _with_load_errors(replay, what, trusted)


def torch_load(f: Any, what: str, trusted: bool, *, map_location: str, mmap: bool = False) -> Any:
    """torch.load with the project's safe-loading rules (allow-listed classes only unless ``trusted``)."""

    def load() -> Any:
        return torch.load(f, map_location=map_location, weights_only=not trusted, mmap=mmap)

    return _with_load_errors(load, what, trusted)


def _with_load_errors(fn: Any, what: str, trusted: bool) -> Any:
    """Run an unpickling ``fn`` under the allow-list; its errors become FormatError/UnsafeCheckpointError."""
    try:
        if trusted:
            return fn()
        with torch.serialization.safe_globals(_allow_list()):
            return fn()
    except pickle.UnpicklingError as e:
        if trusted or ("weights_only" not in str(e) and "Unsupported global" not in str(e)):
            raise FormatError(f"{what} is not a readable torch.save file: {_first_line(e)}") from e
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        name = found.group(1) if found else "an object that is not a tensor or plain Python value"
        raise UnsafeCheckpointError(
            f"{what} holds a pickled {name}; reading it would run code from the checkpoint. If you trust this "
            "checkpoint, pass allow_pickle=True (nxd-ckpt: --allow-pickle)."
        ) from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise FormatError(f"{what} is truncated or not a torch.save file: {_first_line(e)}") from e


def _allow_list() -> list[Any]:
    """The classes plain.load allows (format classes such as xser's TensorReference register there)."""
    return list(getattr(plain, "_extra_safe_globals", []))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
