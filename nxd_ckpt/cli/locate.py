"""The checkpoint a command names: its directory (DIR, local or s3://) as a Storage, and the tag (--tag) in it."""

from __future__ import annotations

import argparse
import os

from nxd_ckpt.cli.output import PROG
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.inspection import Checkpoint, open_checkpoint
from nxd_ckpt.storage import Storage, storage_for


def dir_storage(directory: str, command: str) -> Storage:
    """The storage of a checkpoint directory (the one holding the tags); a missing one, a file or a tag directory
    is refused with the command line to use instead."""
    storage = storage_for(directory)
    if "://" not in directory and not os.path.exists(directory):
        raise CheckpointError(f"{directory}: no such directory")
    if "://" not in directory and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
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
