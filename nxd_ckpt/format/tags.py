"""Tags in a checkpoint directory: which are complete, in which order, which is latest; re-saves of a tag.

A tag is complete only when ``<tag>/done`` exists. Order: the creation time nxd_ckpt records in
``<tag>/nxd_ckpt.json`` (it survives copying a directory), else, for NxD-written tags, the modification time of
``done``; the tag name breaks ties. What retention deletes, and how, is ``format.retention``'s (over this order).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from nxd_ckpt.errors import CheckpointError, CheckpointNotFoundError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.format.metadata import TagMetadata
from nxd_ckpt.format.metadata import read_metadata as _read_tag_metadata
from nxd_ckpt.storage import Storage
from nxd_ckpt.storage.base import DelegatingStorage

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


# --------------------------------------------------------------------------------------------- re-saving a tag
# Saving to a tag that already holds a complete checkpoint writes the new one beside it, in the hidden directory
# layout.resave_dir(tag), through ResaveStorage (so every writer still names files by the tag). Rank 0 commits
# it there ('done' included) and then swaps it in: on storage that can rename directories (a POSIX filesystem),
# tag -> layout.replaced_dir(tag), resave_dir -> tag, sync, delete the old copy; elsewhere (S3) the old tag is
# deleted ('done' first) and the new files are copied to its name ('done' last). At every moment one complete
# copy exists: the old tag until the new one is complete, then the new one under either name. A crash in the
# middle is finished by recover_resaves (rank 0, before every save and load): a complete re-save is swapped
# in, an incomplete one is dropped, and an old copy whose replacement never arrived goes back to its name.


class ResaveStorage(DelegatingStorage):
    """The storage of a re-save: paths under ``tag/`` go to ``layout.resave_dir(tag)/``; the rest pass through."""

    def __init__(self, inner: Storage, tag: str, staging: str | None = None) -> None:
        super().__init__(inner)
        self.tag = layout.validate_tag(tag)
        self.staging = layout.resave_dir(tag) if staging is None else staging

    def _map(self, path: str) -> str:
        if path == self.tag or path.startswith(self.tag + "/"):
            return self.staging + path[len(self.tag) :]
        return path

    def _unmap(self, path: str) -> str:
        if path == self.staging or path.startswith(self.staging + "/"):
            return self.tag + path[len(self.staging) :]
        return path

    def local_path(self, path: str) -> str | None:
        return self.inner.local_path(self._map(path))

    def write_from_local_file(self, path: str, local_file: str) -> None:
        self.inner.write_from_local_file(self._map(path), local_file)

    def open_sequential(self, path: str, direct: bool = False) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.inner.open_sequential(self._map(path), direct)

    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.inner.open_write(self._map(path))

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        self.inner.write_bytes(self._map(path), data)

    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.inner.open_read(self._map(path))

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read_bytes(self._map(path), offset, length)

    def read_buffer(self, path: str, allocate: Any = None) -> Any:
        return self.inner.read_buffer(self._map(path), allocate)

    def exists(self, path: str) -> bool:
        return self.inner.exists(self._map(path))

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(self._map(path))

    def size(self, path: str) -> int:
        return self.inner.size(self._map(path))

    def mtime(self, path: str) -> float:
        return self.inner.mtime(self._map(path))

    def delete(self, path: str) -> None:
        self.inner.delete(self._map(path))

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(self._map(path))

    def sync_dirs(self, paths: Iterable[str]) -> None:
        self.inner.sync_dirs({self._map(p) for p in paths})

    def walk_files(self, path: str = "") -> list[str]:
        return [self._unmap(p) for p in self.inner.walk_files(self._map(path))]


def begin_resave(storage: Storage, tag: str) -> None:
    """Rank 0: start writing a re-save of the complete ``tag`` beside it (a leftover attempt is dropped)."""
    staging = layout.resave_dir(tag)
    storage.delete_tree(staging)
    storage.write_bytes(f"{staging}/{layout.CHECKPOINT_MARKER}", b"1")


def swap_in_resave(storage: Storage, tag: str) -> None:
    """Rank 0, after the re-save of ``tag`` is complete (with a durable ``done``) in its hidden directory:
    give it the tag's name. Also finishes a swap a crash interrupted."""
    staging, old = layout.resave_dir(tag), layout.replaced_dir(tag)
    if not storage.exists(f"{staging}/{layout.DONE_MARKER}"):
        raise CheckpointError(f"{storage.url}/{staging} is not complete; refusing to swap it in as {tag!r}")
    _carry_foreign_files(storage, tag, staging)
    if storage.renames_dirs:
        # Exchanged: the hidden directory holds the old copy (older by its creation time, which is how recovery
        # tells the two apart if a crash comes before the deletion). Two renames: between them the tag is missing
        # (a load or save finishes the swap).
        replace_dir(storage, staging, tag, old)
        return
    # No directory rename (object stores): the complete copy in ``staging`` is what a crash from here keeps.
    storage.delete(layout.tag_path(tag, layout.DONE_MARKER))
    storage.delete_tree(tag)
    files = [p for p in storage.walk_files(staging) if p != f"{staging}/{layout.DONE_MARKER}"]
    for path in files:
        storage.write_bytes(tag + path[len(staging) :], storage.read_bytes(path))
    storage.sync_dirs({tag + p[len(staging) :].rsplit("/", 1)[0] for p in files} | {tag, ""})
    storage.write_bytes(layout.tag_path(tag, layout.DONE_MARKER), b"1")
    storage.sync_dirs([tag])
    delete_copy(storage, staging)


def _carry_foreign_files(storage: Storage, tag: str, staging: str) -> None:
    """Files others keep in the tag folder itself (optimum-neuron's ``mp_metadata_pp_rank_*.json``, which its
    PEFT save writes before saving and its async save right after) go with the re-saved copy unless it has its own."""
    owned = set(layout.TAG_TOP_LEVEL_FILES)
    for path in storage.walk_files(tag):
        name = path[len(tag) + 1 :]
        if "/" in name or name in owned or storage.exists(f"{staging}/{name}"):
            continue
        storage.write_bytes(f"{staging}/{name}", storage.read_bytes(path))
        storage.sync_dirs([staging])


def _is_older_copy(storage: Storage, directory: str, tag: str) -> bool:
    """Whether the complete checkpoint in ``directory`` is older than the complete ``tag`` (so it is the old copy
    an exchange put there, not a re-save waiting to be swapped in)."""
    if not storage.exists(layout.tag_path(tag, layout.DONE_MARKER)):
        return False
    try:
        hidden = _metadata_at(storage, directory)
        current = read_metadata(storage, tag)
    except FormatError:
        return False
    if hidden is None or current is None or hidden.created_at is None or current.created_at is None:
        return False
    return hidden.created_at <= current.created_at


def _metadata_at(storage: Storage, directory: str) -> TagMetadata | None:
    """The metadata of a hidden copy of a tag (its folder is not a tag name); FormatError if damaged."""
    path = f"{directory}/{layout.METADATA_FILE}"
    if not storage.exists(path):
        return None
    return TagMetadata.from_json(storage.read_bytes(path), f"{storage.url}/{path}")


def replace_dir(storage: Storage, new: str, target: str, old: str, marker: str = layout.DONE_MARKER) -> None:
    """Give the complete copy in directory ``new`` the name ``target`` (storage that ``renames_dirs``), durably,
    then delete the copy it replaced (``marker`` first). One atomic exchange where the filesystem has it (the old
    copy then sits at ``new`` until deleted); else two renames through ``old``, between which ``target`` is missing.
    """
    if storage.list_dir(target) and storage.exchange_dirs(new, target):
        storage.sync_dirs([""])
        delete_copy(storage, new, marker)
        return
    if storage.list_dir(target):
        delete_copy(storage, old, marker)  # a replaced copy left by an earlier interrupted swap
        storage.rename_dir(target, old)
    storage.rename_dir(new, target)
    storage.sync_dirs([""])  # the swap is durable before the old copy goes
    delete_copy(storage, old, marker)


def delete_copy(storage: Storage, directory: str, marker: str = layout.DONE_MARKER) -> None:
    """Delete a hidden copy of a checkpoint: its ``marker`` first, so a partial deletion never looks complete."""
    if not storage.list_dir(directory):
        return
    storage.delete(f"{directory}/{marker}")
    storage.sync_dirs([directory])
    storage.delete_tree(directory)


def recover_resaves(storage: Storage, finish_only: bool = False) -> list[str]:
    """Rank 0: finish or undo re-saves a crash interrupted (see above); return the tags touched.

    ``finish_only`` (loads): only swap in complete re-saves and put back an old copy whose tag is missing;
    leave unfinished re-saves alone (another job may be writing one right now)."""
    touched = []
    for name in storage.list_dir(""):
        for prefix in (layout.RESAVE_PREFIX, layout.REPLACED_PREFIX):
            if not name.startswith(prefix):
                continue
            tag = name[len(prefix) :]
            try:
                layout.validate_tag(tag)
            except ValueError:
                continue
            if tag not in touched:
                _recover_resave(storage, tag, finish_only)
                touched.append(tag)
    return touched


def _recover_resave(storage: Storage, tag: str, finish_only: bool) -> None:
    staging, old = layout.resave_dir(tag), layout.replaced_dir(tag)
    if storage.exists(f"{staging}/{layout.DONE_MARKER}") and not _is_older_copy(storage, staging, tag):
        logger.warning("finishing the interrupted re-save of checkpoint %s in %s", tag, storage.url)
        swap_in_resave(storage, tag)
        return
    if storage.exists(f"{staging}/{layout.DONE_MARKER}"):  # the old copy an exchange left: delete it
        if not finish_only:
            delete_copy(storage, staging)
        return
    if finish_only:
        if not storage.list_dir(tag) and storage.exists(f"{old}/{layout.DONE_MARKER}"):
            _restore(storage, tag, old)
        return
    if storage.list_dir(staging):
        logger.warning("dropping the unfinished re-save of checkpoint %s in %s (the old one stays)", tag, storage.url)
        storage.delete_tree(staging)
    if not storage.list_dir(old):
        return
    if storage.exists(layout.tag_path(tag, layout.DONE_MARKER)) or not storage.exists(f"{old}/{layout.DONE_MARKER}"):
        delete_copy(storage, old)
        return
    _restore(storage, tag, old)


def _restore(storage: Storage, tag: str, old: str) -> None:
    """Give the old copy of ``tag`` its name back (its replacement never became complete)."""
    logger.warning("restoring checkpoint %s in %s from its copy %s", tag, storage.url, old)
    if storage.list_dir(tag):
        storage.delete_tree(tag)
    if storage.renames_dirs:
        storage.rename_dir(old, tag)
        storage.sync_dirs([""])
    else:  # pragma: no cover - object stores never create the replaced copy
        raise CheckpointError(f"cannot restore {storage.url}/{tag} from {old}: the storage cannot rename")
