"""The checkpoint a command names: its directory (DIR, local or s3://) as a Storage, and the tag (--tag) in it; or,
for ``list``, ``inspect`` and ``verify``, one checkpoint folder named itself (a DCP folder, the ``checkpoint_id``
handed to ``dcp.load``, or a Hugging Face safetensors folder: ``locate``). Which kind a folder is, is
``format.dcp_folders``' answer."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from nxd_ckpt.cli.output import PROG
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import dcp_folders, layout, tags
from nxd_ckpt.inspection import Checkpoint, open_checkpoint
from nxd_ckpt.storage import Storage, storage_for


@dataclass(frozen=True)
class Target:
    """What DIR names: a directory of checkpoints (``folder`` None; ``storage`` is DIR's), or one checkpoint
    folder (``folder``: what it is; ``storage`` is the directory holding it, so that the commands over a
    directory's folders run on it unchanged)."""

    storage: Storage
    folder: dcp_folders.DcpFolder | None = None


def split_folder(directory: str) -> tuple[str, str] | None:
    """(parent, name) of a folder path or URL; None for a root (``/``, ``s3://bucket``), which is no folder."""
    if "://" in directory:
        parent, _, name = directory.rstrip("/").rpartition("/")
        return (parent, name) if name and not parent.endswith(":/") else None
    parent, name = os.path.split(os.path.abspath(directory))
    return (parent, name) if name else None


def locate(directory: str, command: str, tag: str | None = None) -> Target:
    """DIR as ``list``, ``inspect`` and ``verify`` take it: one complete DCP folder, or a Hugging Face folder,
    named itself; else a directory of checkpoints (``dir_storage``). ``tag`` (``--tag``) only goes with a
    directory: with a folder it is refused, naming the command line that would work."""
    _check_local(directory)
    split = split_folder(directory)
    if split is not None:
        parent, name = split
        storage = storage_for(parent)
        info = dcp_folders.folder_info(storage, name)
        dcp_folder = info.complete and info.kind == dcp_folders.DCP
        # safetensors files beside the library's tags (an export into the checkpoint directory) leave it a
        # directory of tags
        hf_folder = info.kind == dcp_folders.HF and not tags.list_tags(storage_for(directory), include_incomplete=True)
        if dcp_folder or hf_folder:
            if tag is not None and tag != name:
                raise CheckpointError(
                    f"{directory} is one checkpoint folder ({info.kind.upper()}), so --tag {tag} does not apply; "
                    f"for a folder beside it: {PROG} {command} {parent} --tag {tag}"
                )
            return Target(storage, info)
    return Target(dir_storage(directory, command))


def refuse_folder(directory: str, command: str) -> Storage:
    """DIR for the commands over a whole directory (``prune``): a checkpoint folder named itself is refused,
    naming its directory."""
    target = locate(directory, command)
    if target.folder is not None:
        parent = split_folder(directory)[0]  # type: ignore[index]  # a folder always splits
        raise CheckpointError(
            f"{directory} is one checkpoint folder; {command} works on the directory holding them: "
            f"{PROG} {command} {parent}"
        )
    return target.storage


def _check_local(directory: str) -> None:
    """A local DIR must be an existing directory."""
    if "://" not in directory and not os.path.exists(directory):
        raise CheckpointError(f"{directory}: no such directory")
    if "://" not in directory and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory")


def dir_storage(directory: str, command: str) -> Storage:
    """The storage of a checkpoint directory (the one holding the tags); a missing one, a file or a tag directory
    is refused with the command line to use instead."""
    _check_local(directory)
    storage = storage_for(directory)
    if storage.exists(layout.DONE_MARKER) or storage.exists(layout.CHECKPOINT_MARKER):
        path = os.path.normpath(directory)
        parent, tag = os.path.dirname(path) or ".", os.path.basename(path)
        # `list` and `prune` work on the whole directory; the others take --tag.
        fix = f"{PROG} {command} {parent}" + ("" if command in ("list", "prune") else f" --tag {tag}")
        raise CheckpointError(
            f"{directory} is one checkpoint (a tag directory); pass the directory holding the tags instead: {fix}"
        )
    return storage


def open_tag(args: argparse.Namespace) -> Checkpoint:
    """The tag ``args`` names (``dir``, ``--tag``; default the latest complete one); a named tag may be incomplete."""
    storage = dir_storage(args.dir, args.command)
    return open_checkpoint(
        storage, args.tag, allow_incomplete=args.tag is not None, allow_pickle=getattr(args, "allow_pickle", False)
    )
