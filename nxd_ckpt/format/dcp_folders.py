"""A directory of checkpoints in TorchTitan's layout: ``step-N`` folders, each a checkpoint once it holds DCP's
``.metadata`` (``nxd_ckpt.dcp.StorageWriter``'s also hold ``nxd_ckpt/`` manifests), or, for a step TorchTitan
wrote with ``last_save_in_hf``, a Hugging Face safetensors set (complete once it holds its index). What kind a
folder is, is decided here (``folder_info``) and nowhere else: the command asks this module, for a directory of
such folders and for one folder named itself. Listing, ordering and pruning read and delete files only: no torch
import (the command's ``list`` stays fast)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nxd_ckpt.format import layout, resave, tags
from nxd_ckpt.format.manifests import manifest_paths
from nxd_ckpt.storage import Storage

DCP = "dcp"
"""A torch Distributed Checkpoint folder (``.metadata`` and ``*.distcp`` files)."""
HF = "hf"
"""A Hugging Face safetensors folder (``model.safetensors.index.json`` and its files, or ``model.safetensors``)."""


@dataclass(frozen=True)
class DcpFolder:
    """One folder of a checkpoint directory: its ``name``; its ``kind`` (``DCP`` or ``HF``); whether it is
    ``complete`` (it holds ``.metadata``, what makes it a checkpoint for DCP and TorchTitan; for HF its index, or
    the single ``model.safetensors``, ``hf_single``); the ``step`` N of ``step-N`` (None for another name); and
    how many of the library's ``manifests`` it holds (0: written by stock DCP or another writer, or its
    ``nxd_ckpt/`` folder is gone)."""

    name: str
    complete: bool
    step: int | None
    manifests: int
    kind: str = DCP
    hf_single: bool = False
    """HF: the folder is one ``model.safetensors`` without an index."""

    @property
    def sort_key(self) -> tuple[int, int, str]:
        """Oldest first: other names (by name) before ``step-N`` folders by N."""
        return (0, 0, self.name) if self.step is None else (1, self.step, self.name)

    @property
    def marker(self) -> str:
        """The file that makes it complete, deleted first (``.metadata``; for HF the index or the single file)."""
        if self.kind == DCP:
            return layout.DCP_METADATA_FILE
        return layout.HF_SINGLE_FILE if self.hf_single else layout.HF_INDEX_FILE


STEP_FOLDER = re.compile(r"step-(\d+)")
"""TorchTitan's folder name for the checkpoint of step N; the newest N is the one it loads."""


def folder_info(storage: Storage, name: str) -> DcpFolder:
    """What ``name`` (a folder of ``storage``) is: DCP when it holds ``.metadata`` or no safetensors file, else HF."""
    match = STEP_FOLDER.fullmatch(name)
    step = int(match.group(1)) if match else None
    manifests = len(manifest_paths(storage, name))
    if storage.exists(f"{name}/{layout.DCP_METADATA_FILE}"):
        return DcpFolder(name, True, step, manifests)
    files = set(storage.list_dir(name))
    if layout.HF_INDEX_FILE in files:
        return DcpFolder(name, True, step, manifests, HF)
    if any(f.endswith(layout.SAFETENSORS_SUFFIX) for f in files):
        single = layout.HF_SINGLE_FILE in files  # without an index, only the single-file layout is whole
        return DcpFolder(name, single, step, manifests, HF, hf_single=single)
    return DcpFolder(name, False, step, manifests)


def list_folders(storage: Storage) -> list[DcpFolder]:
    """The checkpoint folders of ``storage``, oldest first: the complete DCP ones, HF ones named ``step-N`` (as
    TorchTitan writes its last step; another HF folder beside them, e.g. an export, is not a step: never listed or
    pruned), and ``step-N`` folders that are not complete (a save that never finished). Hidden folders (a save
    being staged) are not listed."""
    found = []
    for name in storage.list_dir(""):
        if name.startswith(".") or not storage.list_dir(name):
            continue
        info = folder_info(storage, name)
        if info.step is not None or (info.complete and info.kind == DCP):
            found.append(info)
    return sorted(found, key=lambda f: f.sort_key)


def is_dcp_directory(storage: Storage) -> bool:
    """Whether ``storage`` holds complete checkpoint folders (DCP or HF) and no tags of the library's own format."""
    return not tags.list_tags(storage, include_incomplete=True) and any(f.complete for f in list_folders(storage))


def latest(folders: Sequence[DcpFolder]) -> str | None:
    """The folder TorchTitan would load: the newest complete one."""
    complete = [f for f in folders if f.complete]
    return complete[-1].name if complete else None


def to_prune(folders: Sequence[DcpFolder], keep: int) -> list[str]:
    """The folders a prune keeping the newest ``keep`` complete ones deletes, oldest first: the older complete
    ones, and unfinished ``step-N`` folders older than the oldest kept."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ordered = sorted(folders, key=lambda f: f.sort_key)
    complete = [f for f in ordered if f.complete]
    if not complete:
        return []
    kept = complete[-keep:]
    doomed = [f for f in complete if f not in kept]
    doomed += [f for f in ordered if not f.complete and f.sort_key < kept[0].sort_key]
    return [f.name for f in sorted(doomed, key=lambda f: f.sort_key)]


def delete_folder(storage: Storage, name: str) -> None:
    """Delete one checkpoint folder, the file that makes it complete first (``.metadata``, or an HF folder's
    index): a partial deletion never looks like a checkpoint."""
    resave.delete_copy(storage, name, folder_info(storage, name).marker)
