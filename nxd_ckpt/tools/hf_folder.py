"""A Hugging Face safetensors folder checked before anything of it is loaded: a folder the library wrote against its
manifests (size and xxh3_64 of every file, no unlisted shard); any folder (one downloaded from the Hub) with the
checks its format allows: every ``.safetensors`` header parsed and bounded by its file, every tensor's byte range
inside it and the data covered exactly (``safetensors_io.check_file``), the index's files and names, and, given what
a model takes, each tensor present with its shape and a dtype it casts from. Every error names the file. The
TorchTitan manager's ``initial_load_in_hf`` runs it before DCP's reader reads a byte.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import IntegrityError, InvalidTagError
from nxd_ckpt.format import layout
from nxd_ckpt.format.manifests import check_record, hash_stream, read_index
from nxd_ckpt.storage import storage_for
from nxd_ckpt.tools import safetensors_io
from nxd_ckpt.tools.safetensors_io import INDEX_FILE, SafetensorsError, TensorEntry


@dataclass(frozen=True)
class Expected:
    """What the model takes for one Hugging Face name: dtype and (global) shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def expected_of(hf_state: Mapping[str, Any]) -> dict[str, Expected]:
    """The dtype and global shape of every tensor of the model's Hugging Face state dict."""
    return {k: Expected(v.dtype, tuple(v.shape)) for k, v in hf_state.items() if isinstance(v, torch.Tensor)}


def check_folder(path: str, expected: Mapping[str, Expected] | None) -> list[str]:
    """Check the Hugging Face folder ``path`` before anything of it is loaded (see the module docstring); with
    ``expected`` (None: a quantized checkpoint, whose tensors are not the model's) each tensor against the model.
    Returns the ``.safetensors`` files checked. IntegrityError for a damaged file, ValueError for one that does not
    fit the model; each names the file."""
    if "://" in path or not os.path.isdir(path):
        raise ValueError(f"Hugging Face weights {path}: not a local folder (safetensors are read from a local folder)")
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"Hugging Face weights {path}: the folder holds no .safetensors file")
    _check_manifests(path, names)
    found: dict[str, tuple[str, TensorEntry]] = {}
    for name in names:
        full = os.path.join(path, name)
        try:
            entries = safetensors_io.check_file(full)
        except SafetensorsError as e:
            raise IntegrityError(f"Hugging Face shard {full} is damaged: {e}; restore or download it again") from e
        for entry in entries:
            if entry.name in found:
                raise IntegrityError(f"{entry.name} is in both {found[entry.name][0]} and {full}; remove the stray")
            found[entry.name] = (full, entry)
    _check_index(path, found)
    if expected is not None:
        _check_against_model(path, found, expected)
    return [os.path.join(path, n) for n in names]


def _check_manifests(path: str, names: list[str]) -> None:
    """A folder with the library's manifests: every listed file's size and digest, and no unlisted shard."""
    parent, folder = os.path.split(os.path.abspath(path))
    if not os.path.isdir(os.path.join(path, layout.EXTRAS_DIR)) or not _is_folder_name(folder):
        return
    root = storage_for(parent)
    index = read_index(root, folder)
    if not index:
        return
    for name in names:
        if name not in index:
            raise IntegrityError(
                f"{path}/{name} is not in the manifests of {path}: it was not written by the save; remove it"
            )
    for rel, rec in sorted(index.items()):
        if rel.startswith(layout.EXTRAS_DIR + "/"):
            continue
        try:
            with root.open_read(f"{folder}/{rel}") as f:
                size, digest = hash_stream(f)
        except FileNotFoundError as e:
            raise IntegrityError(f"{path}/{rel} is missing (listed in the manifests of {path})") from e
        check_record(root.url, folder, f"{folder}/{rel}", rec, size, digest)


def _is_folder_name(name: str) -> bool:
    """Whether ``name`` can be a checkpoint folder of the library (only those have manifests)."""
    try:
        layout.validate_tag(name)
    except InvalidTagError:
        return False
    return True


def _check_index(path: str, found: Mapping[str, tuple[str, TensorEntry]]) -> None:
    """The index, where there is one: every file it names is there and holds the tensors it maps to that file."""
    index = os.path.join(path, INDEX_FILE)
    if not os.path.exists(index):
        return
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{index} is not a safetensors index ({e}); restore or download it again") from e
    for name, file in weight_map.items():
        if not isinstance(file, str) or not re.fullmatch(r"[^/\\]+\.safetensors", file):
            raise IntegrityError(f"{index} maps {name} to {file!r}, which is no .safetensors file of the folder")
        where = found.get(name)
        if where is None or os.path.basename(where[0]) != file:
            held = f"it is in {where[0]}" if where else "no shard holds it"
            missing = "" if os.path.exists(os.path.join(path, file)) else f" ({file} is missing)"
            raise IntegrityError(f"{index} maps {name} to {path}/{file}, but {held}{missing}")


def _check_against_model(
    path: str, found: Mapping[str, tuple[str, TensorEntry]], expected: Mapping[str, Expected]
) -> None:
    """Every tensor the model takes is in a shard, with its shape and a dtype it can be cast from (floating point
    to floating point, as Hub weights in bf16 load into an fp32 model; anything else must match)."""
    for name, want in expected.items():
        where = found.get(name)
        if where is None:
            raise ValueError(f"Hugging Face weights {path}: no shard holds {name}, which the model needs")
        file, entry = where
        if entry.shape != want.shape:
            raise ValueError(
                f"Hugging Face shard {file}: {name} has shape {list(entry.shape)}, but the model's is "
                f"{list(want.shape)}; these weights are for another model configuration"
            )
        if entry.dtype != want.dtype and not (entry.dtype.is_floating_point and want.dtype.is_floating_point):
            raise ValueError(
                f"Hugging Face shard {file}: {name} is {entry.dtype}, which does not cast to the model's {want.dtype}"
            )
