"""Tags in a checkpoint directory: which are complete, which is latest, what retention deletes.

A tag is complete only when ``<tag>/done`` exists. Order: the creation time nxd_ckpt records in
``<tag>/nxd_ckpt.json`` (it survives copying a directory), else, for NxD-written tags, the modification time of
``done``; the tag name breaks ties. Retention deletes ``done`` first, so a crash mid-deletion never leaves a tag
that looks complete.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from . import layout
from .errors import CheckpointNotFoundError, FormatError
from .format.metadata import TagMetadata
from .format.metadata import read_metadata as _read_tag_metadata
from .storage import Storage

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class TagInfo:
    """One tag directory: whether it is complete and its position in the order."""

    name: str
    complete: bool
    order_time: float
    metadata: TagMetadata | None

    @property
    def sort_key(self) -> tuple:
        return (self.order_time, _natural_key(self.name))


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def read_metadata(storage: Storage, tag: str) -> TagMetadata | None:
    """nxd_ckpt's metadata of a tag, or None for tags written by NxD (or unfinished ones); FormatError if damaged.
    (``format.metadata.read_metadata``, the one reader of ``nxd_ckpt.json``.)"""
    return _read_tag_metadata(storage, tag)


def _tag_info(storage: Storage, name: str) -> TagInfo | None:
    try:
        layout.validate_tag(name)
    except ValueError:
        return None
    complete = storage.exists(layout.tag_path(name, layout.DONE_MARKER))
    has_marker = storage.exists(layout.tag_path(name, layout.CHECKPOINT_MARKER))
    if not complete and not has_marker:
        return None  # not a checkpoint directory
    meta = None
    try:
        meta = read_metadata(storage, name)
    except FormatError:
        logger.warning("ignoring unreadable metadata of tag %s in %s", name, storage.url)
    if meta is not None and meta.created_at is not None:
        order_time = meta.created_at
    else:
        marker = layout.DONE_MARKER if complete else layout.CHECKPOINT_MARKER
        order_time = storage.mtime(layout.tag_path(name, marker))
    return TagInfo(name=name, complete=complete, order_time=order_time, metadata=meta)


def list_tags(storage: Storage, include_incomplete: bool = False) -> list[TagInfo]:
    """Tags in order, oldest first; complete ones only unless ``include_incomplete``."""
    infos = [info for name in storage.list_dir("") if (info := _tag_info(storage, name)) is not None]
    infos.sort(key=lambda i: i.sort_key)
    return [i for i in infos if include_incomplete or i.complete]


def latest_tag(storage: Storage) -> str | None:
    """The newest complete tag, or None if there is none."""
    tags = list_tags(storage)
    return tags[-1].name if tags else None


def resolve_tag(storage: Storage, tag: str | None) -> str:
    """The tag to load: ``tag`` itself or, for None, the latest complete one.

    A named tag must be complete, or carry no marker at all while holding state files (NxD's
    ``checkpoint_converter.py`` writes ``pretrained_weight/model/...`` that way and NxD loads it): such a tag
    loads with a warning that its completeness cannot be checked. A tag with ``checkpoint`` but no ``done`` is
    an interrupted save and is refused.
    """
    if tag is None:
        latest = latest_tag(storage)
        if latest is None:
            incomplete = [t.name for t in list_tags(storage, include_incomplete=True)]
            hint = f" (incomplete, without 'done': {', '.join(incomplete)})" if incomplete else _why_empty(storage)
            raise CheckpointNotFoundError(f"no complete checkpoint in {storage.url}{hint}")
        return latest
    layout.validate_tag(tag)
    if storage.exists(layout.tag_path(tag, layout.DONE_MARKER)):
        return tag
    if not storage.exists(layout.tag_path(tag, layout.CHECKPOINT_MARKER)) and _holds_state(storage, tag):
        logger.warning(
            "checkpoint tag %r in %s has no 'checkpoint'/'done' markers (written outside a save, e.g. by NxD's "
            "checkpoint_converter.py); loading it as NxD does, but its completeness cannot be checked",
            tag,
            storage.url,
        )
        return tag
    complete = [t.name for t in list_tags(storage)]
    state = "is incomplete (no 'done' marker: the save was interrupted)" if storage.exists(tag) else "does not exist"
    raise CheckpointNotFoundError(
        f"checkpoint tag {tag!r} in {storage.url} {state}; complete tags: {', '.join(complete) or 'none'}"
        + ("" if complete else _why_empty(storage))
    )


def _holds_state(storage: Storage, tag: str) -> bool:
    """Whether a tag directory holds any state file NxD's load_checkpoint reads."""
    for sub in (layout.MODEL_DIR, layout.OPTIM_DIR):
        if any(
            layout.parse_state_file_name(n) or layout.parse_full_optim_file_name(n)
            for n in storage.list_dir(layout.tag_path(tag, sub))
        ):
            return True
    return any(storage.exists(layout.tag_path(tag, f)) for f in (layout.SCHEDULER_FILE, layout.USER_CONTENT_FILE))


def _why_empty(storage: Storage) -> str:
    """Why a directory holds no tags, as a parenthesised hint: it is missing, empty, or itself one tag folder."""
    if storage.exists(layout.DONE_MARKER) or storage.exists(layout.CHECKPOINT_MARKER):
        parent, _, name = storage.url.rstrip("/").rpartition("/")
        return (
            f" ({storage.url} is one checkpoint, a tag folder; pass the directory holding the tags and the tag: "
            f"checkpoint_dir={parent or '.'!r}, tag={name!r})"
        )
    if not storage.list_dir(""):
        if "://" in storage.url:
            return " (nothing is stored under this prefix)"
        return " (the directory does not exist)" if not os.path.isdir(storage.url) else " (the directory is empty)"
    return " (it holds no tag folder: no subdirectory with a 'checkpoint' or 'done' file)"


def tags_to_delete(tags: list[TagInfo], keep: int, protect: set[str] = frozenset()) -> list[str]:
    """Retention policy (pure): complete tags beyond the newest ``keep``, oldest first, then incomplete tags
    older than the oldest kept complete one. Tags in ``protect`` (saves in flight) are never chosen."""
    if keep < 1:
        raise ValueError(f"num_kept_ckpts must be >= 1, got {keep}")
    ordered = sorted(tags, key=lambda i: i.sort_key)
    complete = [t for t in ordered if t.complete]
    doomed = [t.name for t in complete[: max(0, len(complete) - keep)]]
    kept = complete[-keep:] if complete else []
    if kept:
        oldest_kept = kept[0].sort_key
        doomed += [t.name for t in ordered if not t.complete and t.sort_key < oldest_kept]
    return [name for name in doomed if name not in protect]


def delete_tag(storage: Storage, tag: str) -> None:
    """Delete one tag: ``done`` first (so it stops counting as complete), then everything else."""
    storage.delete(layout.tag_path(tag, layout.DONE_MARKER))
    storage.sync_dirs([layout.validate_tag(tag)])
    storage.delete_tree(tag)


def apply_retention(storage: Storage, keep: int, protect: set[str] = frozenset()) -> list[str]:
    """Delete what the retention policy selects; return the deleted tags. One failed deletion is logged."""
    deleted = []
    for name in tags_to_delete(list_tags(storage, include_incomplete=True), keep, protect):
        try:
            delete_tag(storage, name)
            deleted.append(name)
        except Exception as e:
            logger.warning("retention could not delete checkpoint %s in %s: %s", name, storage.url, e)
    return deleted
