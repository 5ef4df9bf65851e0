"""How an offline tool (convert-zero1, reshard, import) writes a tag: the same commit protocol as a save.

``begin`` refuses a directory that already holds a checkpoint (or, when asked, removes it ``done`` first) and
writes the ``checkpoint`` marker; the tool writes its files; ``commit`` writes ``nxd_ckpt.json``, checksums
every file into one manifest (``manifest_ranks=1``: one process wrote the tag), makes every directory durable
and writes ``done`` last. A crash anywhere before ``done`` leaves a tag that no loader takes for complete.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout, manifests
from nxd_ckpt.format.metadata import TagMetadata, write_metadata
from nxd_ckpt.save.commit import complete_folder
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.storage.local import atomic_file

_NOT_CARRIED = {layout.DONE_MARKER, layout.CHECKPOINT_MARKER, layout.METADATA_FILE}


def holds_checkpoint(tag_dir: str) -> bool:
    """Whether ``tag_dir`` has a marker, metadata or any model/optimizer file (a checkpoint or part of one)."""
    if not os.path.isdir(tag_dir):
        return False
    markers = (layout.DONE_MARKER, layout.CHECKPOINT_MARKER, layout.METADATA_FILE)
    if any(os.path.exists(os.path.join(tag_dir, m)) for m in markers):
        return True
    return any(
        os.path.isdir(os.path.join(tag_dir, d)) and os.listdir(os.path.join(tag_dir, d))
        for d in (layout.MODEL_DIR, layout.OPTIM_DIR)
    )


def begin(root: str, tag: str, *, overwrite: bool = False, overwrite_hint: str = "pass --overwrite") -> LocalStorage:
    """Start writing ``root/tag``: refuse an existing checkpoint there unless ``overwrite`` (then it is removed,
    ``done`` first), create the directory and write the ``checkpoint`` marker; return the storage of ``root``."""
    tag_dir = os.path.join(root, layout.validate_tag(tag))
    if holds_checkpoint(tag_dir):
        if not overwrite:
            raise CheckpointError(
                f"output directory {tag_dir} already holds a checkpoint; choose a new tag directory"
                + (f" or {overwrite_hint} to replace it" if overwrite_hint else "")
            )
        done = os.path.join(tag_dir, layout.DONE_MARKER)
        if os.path.exists(done):
            os.unlink(done)  # first, so a crash mid-deletion never leaves something that looks complete
        shutil.rmtree(tag_dir)
    elif os.path.exists(tag_dir) and not os.path.isdir(tag_dir):
        raise CheckpointError(f"output {tag_dir} is a file, not a directory; choose another output")
    os.makedirs(tag_dir, exist_ok=True)
    storage = LocalStorage(root)
    storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
    return storage


def output_metadata(source: TagMetadata | None, tag: str, **changes: Any) -> TagMetadata:
    """The output tag's ``nxd_ckpt.json``: the source tag's (a fresh one when it has none: NxD-written tags) named
    ``tag``, keeping its creation time (now for a fresh one) and torch version (this torch's when unknown),
    ``world_size`` cleared (one process writes it), with ``changes`` (the new layout, what it was converted from)."""
    base = source or TagMetadata(tag=tag, created_at=None)
    return base.with_changes(
        tag=tag,
        created_at=time.time() if base.created_at is None else base.created_at,
        world_size=None,
        torch_version=base.torch_version or torch.__version__,
        **changes,
    )


def zero1_layout(dp: int | None) -> dict[str, Any]:
    """The metadata fields of a tag whose ZeRO-1 optimizer state is cut into ``dp`` shards (None: kept full)."""
    return {"dp": dp, "zero1": True, "zero1_dp_size": dp, "zero1_full": dp is None}


def commit(storage: LocalStorage, meta: TagMetadata) -> None:
    """Finish the tag ``meta.tag``: metadata (``manifest_ranks=1``), one manifest of every file, durable
    directories, then ``done`` last."""
    tag = meta.tag
    write_metadata(storage, meta.with_changes(manifest_ranks=1))
    extras = layout.tag_path(tag, layout.EXTRAS_DIR) + "/"
    rels = [
        path[len(tag) + 1 :]
        for path in storage.walk_files(tag)
        if path[len(tag) + 1 :] not in (layout.DONE_MARKER, layout.CHECKPOINT_MARKER) and not path.startswith(extras)
    ]
    manifests.write_manifest(storage, tag, 0, manifests.record_files(storage, tag, rels, rank=0))
    # Every directory of the tag and the tag's own entry in the checkpoint directory are durable before 'done'
    # is: a power cut must not leave 'done' beside lost files.
    tag_dir = os.path.join(storage.root, tag)
    storage.sync_dirs({os.path.relpath(d, storage.root).replace(os.sep, "/") for d, _, _ in os.walk(tag_dir)} | {""})
    complete_folder(storage, tag, b"1", None)  # 'done' last (the commit's), durable before the tool returns


def carry_over(in_dir: str, out_dir: str, skip_dirs: Sequence[str] = ()) -> int:
    """Copy a tag's files except those under ``skip_dirs`` (top-level folders), markers, metadata and per-rank
    manifests (their checksums name the replaced files); return the number of files copied."""
    copied = 0
    for dirpath, _, files in os.walk(in_dir):
        rel_dir = os.path.relpath(dirpath, in_dir)
        top = rel_dir.split(os.sep)[0]
        if top in skip_dirs:
            continue
        for name in files:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel in _NOT_CARRIED or ".tmp-" in name:
                continue
            if top == layout.EXTRAS_DIR and name.startswith("manifest_"):
                continue
            with atomic_file(os.path.join(out_dir, rel)) as tmp:
                shutil.copyfile(os.path.join(dirpath, name), tmp)
            copied += 1
    return copied
