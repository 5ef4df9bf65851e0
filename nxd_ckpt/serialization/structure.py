"""The structure of a ``torch.save`` file without its tensor data, and safe loading with clear errors.

``load_structure`` replays a file's ``data.pkl`` with storages on the ``meta`` device, so only the zip directory
and the pickle are read (``torch.load(map_location="meta")`` still reads every record in torch < 2.10). Each
meta storage remembers its zip record (``RECORD_ATTR``), so a reader can fetch just the records it needs.
Both functions follow plain.load's rules: allow-listed classes only unless ``trusted``.
"""

from __future__ import annotations

import functools
import struct
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
    reader, pickled = torchzip.open_zip(f, what)
    if reader.has_record("byteorder") and reader.get_record("byteorder") not in (b"little", "little"):
        raise FormatError(f"{what} was written on a big-endian machine; its tensors cannot be read by range")
    state, keys = _replay_on_meta(pickled, what, trusted)
    return state, {k: reader.get_record_offset(f"data/{k}") for k in keys}


def _replay_on_meta(pickled: bytes, what: str, trusted: bool) -> tuple[Any, tuple[str, ...]]:
    """``data.pkl`` replayed with storages on ``meta`` (each tagged with its record) and the records it names."""
    keys: list[str] = []

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        untyped = torch.UntypedStorage(nbytes, device="meta")
        setattr(untyped, RECORD_ATTR, key)
        keys.append(key)
        return untyped

    state = torchzip.load_records(pickled, source, what=what, trusted=trusted)
    return state, tuple(keys)


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
"""A zip local file header: signature, versions, flags, method, time, date, crc, sizes, name and extra lengths."""
_LOCAL_SIGNATURE = b"PK\x03\x04"


def head_layout(head: Any, what: str, trusted: bool = False) -> tuple[Any, dict[str, int]] | None:
    """``load_layout`` from the first bytes of a torch.save file alone (``head``), without its zip directory at
    the end: torch.save writes ``data.pkl`` first and each tensor record after a local header, so where the head
    holds the pickle and the local header of every record it names, their offsets are known. None where it does
    not (a record past the head, a compressed record, a big-endian file, a pickle it cannot replay):
    ``load_layout`` then reads the directory and says what is wrong. ``what`` names the file in a
    ``load_layout`` caller's errors; here nothing is raised."""
    data = bytes(head)
    records: dict[str, int] = {}
    pos = data.find(_LOCAL_SIGNATURE)
    tensors_at = len(data)
    while pos != -1 and pos + _LOCAL_HEADER.size <= len(data):
        method, name_length, extra_length = (_LOCAL_HEADER.unpack_from(data, pos)[i] for i in (3, 9, 10))
        name_start = pos + _LOCAL_HEADER.size
        start = name_start + name_length + extra_length
        name = data[name_start : name_start + name_length].split(b"/", 1)[-1].decode("utf-8", "replace")
        if method != 0 or start > len(data):
            return None
        records.setdefault(name, start)
        if name.startswith("data/"):
            tensors_at = pos
            break  # tensor bytes follow: no header is looked for inside them
        pos = data.find(_LOCAL_SIGNATURE, start)
    order = records.get("byteorder")
    if "data.pkl" not in records or (order is not None and data[order : order + 6] != b"little"):
        return None
    try:  # the same pickle (a tensor of the same dtype, shape and strides) is replayed once
        state, keys = _replayed(data[records["data.pkl"] : tensors_at], trusted)
    except Exception:
        return None
    if any(f"data/{k}" not in records for k in keys):
        return None
    return state, {k: records[f"data/{k}"] for k in keys}


@functools.lru_cache(maxsize=256)
def _replayed(pickled: bytes, trusted: bool) -> tuple[Any, tuple[str, ...]]:
    """``data.pkl`` replayed with meta storages (each tagged with its record) and the records it names, kept by
    its bytes: a checkpoint's tensors of one shape share them. Callers must not change what it returns."""
    return _replay_on_meta(pickled, "data.pkl", trusted)
