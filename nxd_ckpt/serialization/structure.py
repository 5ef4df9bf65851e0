"""The structure of a ``torch.save`` file without its tensor data, and safe loading with clear errors.

``load_structure`` replays a file's ``data.pkl`` with storages on the ``meta`` device, so only the zip directory
and the pickle are read (``torch.load(map_location="meta")`` still reads every record in torch < 2.10). Each
meta storage remembers its zip record (``RECORD_ATTR``), so a reader can fetch just the records it needs.
Both functions follow plain.load's rules: allow-listed classes only unless ``trusted``.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_ckpt.errors import FormatError
from nxd_ckpt.serialization import torchzip

RECORD_ATTR = "_nxd_ckpt_record"
"""Attribute set on each meta storage: the name of the zip record (``data/<key>``'s key) holding its bytes."""


def load_structure(f: Any, what: str, trusted: bool = False) -> Any:
    """A torch.save file's structure with every tensor on the ``meta`` device (shape, dtype, no data).

    Only the zip directory and ``data.pkl`` are read: the pickle is replayed with storages that allocate
    nothing (torch.load(map_location="meta") reads every record in torch < 2.10). Same safety rules as
    loading: allow-listed classes only unless ``trusted``. Legacy (non-zip) files fall back to torch.load.
    """
    try:
        _, pickled = torchzip.open_zip(f, what)
    except FormatError:
        f.seek(0)
        if f.read(1) != b"\x80":  # neither a zip nor a legacy torch.save pickle
            raise
        f.seek(0)
        return torch_load(f, what, trusted, map_location="meta")

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        storage = torch.UntypedStorage(nbytes, device="meta")
        setattr(storage, RECORD_ATTR, key)  # which zip record holds the data, for ranged reads
        return storage

    return torchzip.load_records(pickled, source, what=what, trusted=trusted)


def torch_load(f: Any, what: str, trusted: bool, *, map_location: str, mmap: bool = False) -> Any:
    """torch.load with the project's safe-loading rules (allow-listed classes only unless ``trusted``)."""
    return torchzip.torch_load(f, what, trusted, map_location=map_location, mmap=mmap)


def load_layout(f: Any, what: str, trusted: bool = False) -> tuple[Any, dict[str, int]]:
    """A torch.save zip file's structure (``load_structure``: tensors on ``meta``, each storage tagged with its
    record) and each tensor record's data offset in the file, for reading tensor bytes by range; only the zip
    directory and ``data.pkl`` are read. FormatError if it is not a zip file or was written big-endian."""
    keys: list[str] = []

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        untyped = torch.UntypedStorage(nbytes, device="meta")
        setattr(untyped, RECORD_ATTR, key)
        keys.append(key)
        return untyped

    reader, pickled = torchzip.open_zip(f, what)
    if reader.has_record("byteorder") and reader.get_record("byteorder") not in (b"little", "little"):
        raise FormatError(f"{what} was written on a big-endian machine; its tensors cannot be read by range")
    state = torchzip.load_records(pickled, source, what=what, trusted=trusted)
    return state, {k: reader.get_record_offset(f"data/{k}") for k in keys}
