"""Tags in a checkpoint directory: which are complete, in which order, which is latest (re-saves: ``format.resave``).

A tag is complete only when ``<tag>/done`` exists. Order: the creation time nxd_ckpt records in
``<tag>/nxd_ckpt.json`` (it survives copying a directory), else, for NxD-written tags, the modification time of
``done``; the tag name breaks ties. What retention deletes, and how, is ``format.retention``'s (over this order).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

from nxd_ckpt.errors import CheckpointNotFoundError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.format.metadata import TagMetadata
from nxd_ckpt.format.metadata import read_metadata as _read_tag_metadata
from nxd_ckpt.format.resave import (  # the re-save protocol's old import path (tags.ResaveStorage, ...)
    ResaveStorage,
    begin_resave,
    delete_copy,
    recover_resaves,
    replace_dir,
    swap_in_resave,
)
from nxd_ckpt.storage import Storage

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class TagInfo:
    """One tag directory: whether it is complete and its position in the order."""

    name: str
    complete: bool
    order_time: float
    metadata: TagMetadata | None
    time_resolution_s: float = 0.0
    """How coarse ``order_time`` is: 0 for the recorded creation time, the storage's mtime resolution for a
    marker's mtime (tags without metadata)."""

    @property
    def sort_key(self) -> tuple:
        return (self.order_time, _natural_key(self.name))

    def surely_before(self, other: TagInfo) -> bool:
        """Whether this tag began before ``other`` beyond doubt: a whole-second mtime (S3) of an interrupted save
        is only older once its second has ended before ``other`` began (else a save started just after ``other``
        could be taken for an old leftover)."""
        if self.time_resolution_s > 0:
            return self.order_time + self.time_resolution_s <= other.order_time
        return self.sort_key < other.sort_key


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
    resolution = 0.0
    if meta is not None and meta.created_at is not None:
        order_time = meta.created_at
    else:
        marker = layout.DONE_MARKER if complete else layout.CHECKPOINT_MARKER
        order_time = storage.mtime(layout.tag_path(name, marker))
        resolution = storage.mtime_resolution_s
    return TagInfo(name=name, complete=complete, order_time=order_time, metadata=meta, time_resolution_s=resolution)


def list_tags(storage: Storage, include_incomplete: bool = False) -> list[TagInfo]:
    """Tags in order, oldest first; complete ones only unless ``include_incomplete``."""
    infos = [info for name in storage.list_dir("") if (info := _tag_info(storage, name)) is not None]
    infos.sort(key=lambda i: i.sort_key)
    return [i for i in infos if include_incomplete or i.complete]


def latest_tag(storage: Storage) -> str | None:
    """The newest complete tag, or None if there is none, in a few requests however many tags there are.

    One listing of the root (1 LIST per 1,000 names) and the root's tag index (``layout.TAG_INDEX_FILE``, 1 GET)
    give every tag's name and, for those nxd_ckpt committed, its creation time; tags the index does not know
    (written by NxD, copied in, interrupted) are read as ``list_tags`` does. Candidates are then checked newest
    first (``done``, metadata) until one is complete with the time the index says: a stale or missing index
    costs requests, never a half-written answer. (A tag the index knows that something other than nxd_ckpt
    deleted and re-created under the same name is ordered by the index's time unless it is the first candidate.)"""
    names = [n for n in storage.list_dir("") if _is_tag_name(n)]
    index = read_tag_index(storage)
    candidates: dict[str, tuple[tuple, bool]] = {}  # name -> (sort key, verified)
    for name in names:
        if name in index:
            candidates[name] = ((index[name], _natural_key(name)), False)
        elif (info := _tag_info(storage, name)) is not None and info.complete:
            candidates[name] = (info.sort_key, True)
    while candidates:
        name = max(candidates, key=lambda n: candidates[n][0])
        _, verified = candidates.pop(name)
        if verified:
            return name
        info = _tag_info(storage, name)
        if info is None or not info.complete:
            continue  # deleted since the index was written, or being deleted
        if info.order_time == index[name]:
            return name
        candidates[name] = (info.sort_key, True)  # re-saved or re-created since: in its place by its real time
    return None


def _is_tag_name(name: str) -> bool:
    try:
        layout.validate_tag(name)
        return True
    except ValueError:
        return False


def read_tag_index(storage: Storage) -> dict[str, float]:
    """The root's tag index: tag -> creation time of the tags nxd_ckpt committed ({} if missing or unreadable)."""
    try:
        data = json.loads(storage.read_bytes(layout.TAG_INDEX_FILE))
        entries = data["tags"]
        return {str(k): float(v) for k, v in entries.items() if _is_tag_name(str(k))}
    except Exception as e:  # missing (the storages say "file not found") or damaged: latest_tag reads every tag
        if isinstance(e, FileNotFoundError) or str(e).startswith("file not found"):
            return {}
        logger.warning("ignoring unreadable %s in %s: %s", layout.TAG_INDEX_FILE, storage.url, e)
        return {}


def record_committed(storage: Storage, tag: str, created_at: float) -> None:
    """Rank 0, after ``tag``'s ``done``: add it to the root's tag index, dropping tags no longer listed (the
    first time, the index starts from every complete tag). Never fails the save: a failure is logged."""
    try:
        listed = {n for n in storage.list_dir("") if _is_tag_name(n)}
        index = read_tag_index(storage)
        if not index:
            index = {t.name: t.order_time for t in list_tags(storage) if t.metadata is not None}
        index = {n: t for n, t in index.items() if n in listed}
        index[layout.validate_tag(tag)] = created_at
        storage.write_bytes(layout.TAG_INDEX_FILE, json.dumps({"version": 1, "tags": index}).encode())
    except Exception as e:
        logger.warning("could not update %s in %s (latest_tag reads every tag instead): %s",
                       layout.TAG_INDEX_FILE, storage.url, e)  # fmt: skip


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
    return _holds_state_at(storage, layout.validate_tag(tag) + "/")


def holds_complete_checkpoint(storage: Storage, tag: str) -> bool:
    """Whether ``tag`` has ``done`` and state files: a bare ``done`` (optimum-neuron touches ``shards/done`` before
    it saves into a new directory) is no checkpoint to keep beside a re-save."""
    return storage.exists(layout.tag_path(tag, layout.DONE_MARKER)) and _holds_state(storage, tag)


def _holds_state_at(storage: Storage, prefix: str) -> bool:
    """Whether ``prefix`` ("" or "tag/") holds model/optim state files, a scheduler or user content."""
    for sub in (layout.MODEL_DIR, layout.OPTIM_DIR):
        if any(
            layout.parse_state_file_name(n) or layout.parse_full_optim_file_name(n)
            for n in storage.list_dir(prefix + sub)
        ):
            return True
    return any(storage.exists(prefix + f) for f in (layout.SCHEDULER_FILE, layout.USER_CONTENT_FILE))


def is_tag_folder(storage: Storage) -> bool:
    """Whether the storage's root is one tag folder rather than the directory holding tags: it carries a
    ``done``/``checkpoint`` marker, or holds state files itself without markers, as NxD's offline tools write
    them (``convert_zero_checkpoints.py`` writes only ``<output_dir>/optim/...``, ``checkpoint_converter.py``
    only ``model/...``)."""
    if storage.exists(layout.DONE_MARKER) or storage.exists(layout.CHECKPOINT_MARKER):
        return True
    return _holds_state_at(storage, "")


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


__all__ = [
    "ResaveStorage",
    "TagInfo",
    "begin_resave",
    "delete_copy",
    "holds_complete_checkpoint",
    "is_tag_folder",
    "latest_tag",
    "list_tags",
    "read_metadata",
    "read_tag_index",
    "record_committed",
    "recover_resaves",
    "replace_dir",
    "resolve_tag",
    "swap_in_resave",
]
