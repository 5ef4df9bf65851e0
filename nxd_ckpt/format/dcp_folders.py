"""A directory of DCP checkpoints in TorchTitan's layout: ``step-N`` folders, each a checkpoint once it holds DCP's
``.metadata`` (``nxd_ckpt.dcp.StorageWriter``'s also hold ``nxd_ckpt/`` manifests). Listing, ordering and pruning
them reads and deletes files only: no torch import (the command's ``list`` stays fast)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nxd_ckpt.format import layout, resave, tags
from nxd_ckpt.format.manifests import manifest_paths
from nxd_ckpt.storage import Storage


@dataclass(frozen=True)
class DcpFolder:
    """One folder of a DCP checkpoint directory: its ``name``; whether it is ``complete`` (it holds ``.metadata``,
    what makes it a checkpoint for DCP and TorchTitan); the ``step`` N of ``step-N`` (None for another name); and how
    many of the library's ``manifests`` it holds (0: written by stock DCP, or its ``nxd_ckpt/`` folder is gone)."""

    name: str
    complete: bool
    step: int | None
    manifests: int

    @property
    def sort_key(self) -> tuple[int, int, str]:
        """Oldest first: other names (by name) before ``step-N`` folders by N."""
        return (0, 0, self.name) if self.step is None else (1, self.step, self.name)


STEP_FOLDER = re.compile(r"step-(\d+)")
"""TorchTitan's folder name for the checkpoint of step N; the newest N is the one it loads."""


def folder_info(storage: Storage, name: str) -> DcpFolder:
    """What ``name`` (a folder of ``storage``) is."""
    match = STEP_FOLDER.fullmatch(name)
    return DcpFolder(
        name=name,
        complete=storage.exists(f"{name}/{layout.DCP_METADATA_FILE}"),
        step=int(match.group(1)) if match else None,
        manifests=len(manifest_paths(storage, name)),
    )


def list_folders(storage: Storage) -> list[DcpFolder]:
    """The DCP checkpoint folders of ``storage``, oldest first: those holding ``.metadata``, and ``step-N`` folders
    without it (a save that never finished). Hidden folders (a save being staged) are not listed."""
    found = []
    for name in storage.list_dir(""):
        if name.startswith(".") or not storage.list_dir(name):
            continue
        info = folder_info(storage, name)
        if info.complete or info.step is not None:
            found.append(info)
    return sorted(found, key=lambda f: f.sort_key)


def is_dcp_directory(storage: Storage) -> bool:
    """Whether ``storage`` holds DCP checkpoint folders and no tags of the library's own format."""
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
    """Delete one checkpoint folder, ``.metadata`` first: a partial deletion never looks like a checkpoint."""
    resave.delete_copy(storage, name, layout.DCP_METADATA_FILE)
