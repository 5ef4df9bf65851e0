"""The checks of a Hugging Face safetensors folder, in one place: before the TorchTitan manager's
``initial_load_in_hf`` reads a byte of it (``check_folder``: the first problem raised), and for ``nxd-ckpt verify``
(``survey_folder``: every problem and note collected, for the command line to report).

A folder the library wrote is checked against its manifests (size and xxh3_64 of every listed file, no unlisted
shard or index); any folder (one downloaded from the Hub) with the checks its format allows: every ``.safetensors``
header parsed and bounded by its file, every tensor's byte range inside it and the data covered exactly
(``safetensors_io.check_file``), no tensor in two files, and the index's files present and its names in their
headers; given what a model takes, each tensor present with its shape and a dtype it casts from. Every problem
names its file. Imports torch (through ``safetensors_io``): the command line imports this module on first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt.errors import IntegrityError, InvalidTagError
from nxd_ckpt.format import layout
from nxd_ckpt.format.manifests import check_record, hash_stream, read_manifests
from nxd_ckpt.storage import storage_for
from nxd_ckpt.tools import safetensors_io
from nxd_ckpt.tools.safetensors_io import INDEX_FILE, SafetensorsError, TensorEntry

RESTORE = "restore it from a copy or download it again"


@dataclass(frozen=True)
class Expected:
    """What the model takes for one Hugging Face name: dtype and (global) shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def expected_of(hf_state: Mapping[str, Any]) -> dict[str, Expected]:
    """The dtype and global shape of every tensor of the model's Hugging Face state dict."""
    return {k: Expected(v.dtype, tuple(v.shape)) for k, v in hf_state.items() if isinstance(v, torch.Tensor)}


def shard_names(path: str) -> list[str]:
    """The ``.safetensors`` files of the local folder ``path``, sorted."""
    return sorted(n for n in os.listdir(path) if n.endswith(layout.SAFETENSORS_SUFFIX))


@dataclass
class FolderCheck:
    """What checking the folder ``path`` found. ``problems``: IntegrityError for a damaged or inconsistent file,
    ValueError for one that does not fit the model, each naming its file, in the order found; ``notes``: what a
    user should know but is no fault. With ``fail_fast`` the first problem is raised instead of collected."""

    path: str
    fail_fast: bool = False
    shards: list[str] = field(default_factory=list)
    """The ``.safetensors`` files, by name."""
    index: bool = False
    """Whether an index was read (so it counts as a file checked)."""
    manifests: int = 0
    """The ranks' manifests read intact: with any, every listed file was checked by checksum."""
    checksummed_bytes: int = 0
    tensors: dict[str, tuple[str, TensorEntry]] = field(default_factory=dict)
    """{tensor: (file name, entry)} of the intact shards."""
    problems: list[Exception] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, problem: Exception) -> None:
        if self.fail_fast:
            raise problem
        self.problems.append(problem)

    @property
    def files_checked(self) -> int:
        return len(self.shards) + int(self.index)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def check_folder(path: str, expected: Mapping[str, Expected] | None) -> list[str]:
    """Check the Hugging Face folder ``path`` before anything of it is loaded (see the module docstring); with
    ``expected`` (None: a quantized checkpoint, whose tensors are not the model's) each tensor against the model.
    Returns the ``.safetensors`` files checked. Raises the first problem: IntegrityError for a damaged file,
    ValueError for one that does not fit the model; each names the file."""
    check = survey_folder(path, expected, fail_fast=True)
    return [check.file(n) for n in check.shards]


def survey_folder(path: str, expected: Mapping[str, Expected] | None = None, *, fail_fast: bool = False) -> FolderCheck:
    """Every check of the local folder ``path`` (the module docstring), its problems collected (``fail_fast``:
    the first raised). ValueError when ``path`` is not a local folder."""
    if "://" in path or not os.path.isdir(path):
        raise ValueError(f"Hugging Face weights {path}: not a local folder (safetensors are read from a local folder)")
    check = FolderCheck(path, fail_fast, shard_names(path))
    if not check.shards:
        check.add(ValueError(f"Hugging Face weights {path}: the folder holds no .safetensors file"))
        return check
    _check_manifests(check)
    intact = _check_shards(check)
    _check_index(check, intact)
    if expected is not None:
        _check_against_model(check, expected)
    return check


def _check_manifests(check: FolderCheck) -> None:
    """A folder with the library's manifests: every shard and the index listed (checked first: it costs no
    read), and every listed file's size and checksum."""
    parent, folder = os.path.split(os.path.abspath(check.path))
    if not os.path.isdir(check.file(layout.EXTRAS_DIR)):
        return
    if not _is_folder_name(folder):
        check.notes.append(
            f"{check.file(layout.EXTRAS_DIR)} was not read: {folder!r} is no folder name the library writes"
        )
        return
    root = storage_for(parent)
    found = read_manifests(root, folder, check_metadata=False)  # the metadata is a listed file: checked below
    for problem in found.problems:
        check.add(problem)
    check.manifests = len(found.ranks)
    if not found.index:
        return
    unlisted = [n for n in check.shards if n not in found.index]
    if os.path.exists(check.file(INDEX_FILE)) and INDEX_FILE not in found.index:
        unlisted.append(INDEX_FILE)
    for name in unlisted:
        check.add(
            IntegrityError(
                f"{check.file(name)} is not in the manifests of {check.path}: the save did not write it, so its "
                "contents cannot be checked; remove it, or restore the folder from a copy"
            )
        )
    for rel, rec in sorted(found.index.items()):
        try:
            with root.open_read(f"{folder}/{rel}") as f:
                check_record(root.url, folder, f"{folder}/{rel}", rec, *hash_stream(f))
        except FileNotFoundError:
            check.add(IntegrityError(f"{check.file(rel)} is missing (listed in rank {rec.rank}'s manifest); {RESTORE}"))
            continue
        except IntegrityError as e:
            check.add(e)
        check.checksummed_bytes += rec.size


def _is_folder_name(name: str) -> bool:
    """Whether ``name`` can be a checkpoint folder of the library (only those have manifests)."""
    try:
        layout.validate_tag(name)
    except InvalidTagError:
        return False
    return True


def _check_shards(check: FolderCheck) -> set[str]:
    """Every shard's header against its file (``safetensors_io.check_file``), no tensor in two shards; the
    names of the intact shards."""
    intact: set[str] = set()
    for name in check.shards:
        try:
            entries = safetensors_io.check_file(check.file(name))
        except SafetensorsError as e:
            check.add(IntegrityError(f"{e}; the shard is damaged: {RESTORE}"))
            continue
        intact.add(name)
        for entry in entries:
            if entry.name in check.tensors:
                other = check.file(check.tensors[entry.name][0])
                check.add(IntegrityError(f"{entry.name} is in both {other} and {check.file(name)}; remove the stray"))
                continue
            check.tensors[entry.name] = (name, entry)
    return intact


def _check_index(check: FolderCheck, intact: set[str]) -> None:
    """The index, where there is one: every file it names is there, and every tensor it maps to an intact shard
    is in that shard's header (a loader would fail on it); a shard it does not name is a note (loaders never
    open it)."""
    index = check.file(INDEX_FILE)
    if not os.path.exists(index):
        return
    try:
        weight_map = safetensors_io.read_weight_map(index)
    except SafetensorsError as e:
        check.add(IntegrityError(f"{e}; {RESTORE}"))
        return
    check.index = True
    named = set(weight_map.values())
    for name in sorted(named - set(check.shards)):
        check.add(IntegrityError(f"{check.file(name)} is missing ({index} maps tensors to it); {RESTORE}"))
    for name in sorted(set(check.shards) - named):
        check.notes.append(f"{check.file(name)} is not named by {INDEX_FILE}: loaders never open it")
    for tensor, name in sorted(weight_map.items()):
        held = check.tensors.get(tensor)
        if name in intact and (held is None or held[0] != name):
            found = f"it is in {held[0]}" if held else "no shard holds it"
            check.add(IntegrityError(f"{index} maps {tensor} to {name}, but {found}; {RESTORE}"))


def _check_against_model(check: FolderCheck, expected: Mapping[str, Expected]) -> None:
    """Every tensor the model takes is in a shard, with its shape and a dtype it can be cast from (floating point
    to floating point, as Hub weights in bf16 load into an fp32 model; anything else must match)."""
    for name, want in expected.items():
        held = check.tensors.get(name)
        if held is None:
            check.add(ValueError(f"Hugging Face weights {check.path}: no shard holds {name}, which the model needs"))
            continue
        file, entry = check.file(held[0]), held[1]
        if entry.shape != want.shape:
            check.add(
                ValueError(
                    f"Hugging Face shard {file}: {name} has shape {list(entry.shape)}, but the model's is "
                    f"{list(want.shape)}; these weights are for another model configuration"
                )
            )
        elif entry.dtype != want.dtype and not (entry.dtype.is_floating_point and want.dtype.is_floating_point):
            check.add(
                ValueError(
                    f"Hugging Face shard {file}: {name} is {entry.dtype}, which does not cast to the model's "
                    f"{want.dtype}"
                )
            )
