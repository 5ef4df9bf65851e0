"""Re-saving a tag: the new checkpoint written beside the complete old one, then swapped in; and the recovery of a
swap a crash interrupted. The commit (``save/commit.py``) begins and ends a re-save through this module, for NxD
tags and DCP folders alike (their names and rules: ``layout.CommitLayout``; NxD's by default); loads finish a swap a
crash left half done (``recover_resaves``).

Saving to a tag that already holds a complete checkpoint writes the new one beside it, in the hidden directory
``layout.resave_dir(tag)``, through ``ResaveStorage`` (so every writer still names files by the tag). Rank 0 commits
it there (``done`` included) and then swaps it in: on storage that can rename directories (a POSIX filesystem),
tag -> ``layout.replaced_dir(tag)``, resave_dir -> tag, sync, delete the old copy; elsewhere (S3) the old tag is
deleted (``done`` first) and the new files are copied to its name (``done`` last). At every moment one complete
copy exists: the old tag until the new one is complete, then the new one under either name. A crash in the
middle is finished by ``recover_resaves`` (rank 0, before every save and load): a complete re-save is swapped
in, an incomplete one is dropped, and an old copy whose replacement never arrived goes back to its name. A DCP
folder a crash left missing between the two renames is given back its complete copy by ``finish_swap``, which
every rank of a load may run at once (``dcp.place.CheckpointPlace.repair``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, BinaryIO

from nxd_ckpt.errors import CheckpointError, FormatError, StorageError
from nxd_ckpt.format import layout
from nxd_ckpt.format.layout import NXD_COMMIT, CommitLayout
from nxd_ckpt.format.metadata import TagMetadata, read_metadata
from nxd_ckpt.storage import Storage
from nxd_ckpt.storage.base import DelegatingStorage

logger = logging.getLogger("nxd_ckpt")


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


def begin_resave(storage: Storage, tag: str, spec: CommitLayout = NXD_COMMIT) -> None:
    """Rank 0: start writing a save of ``tag`` in its staging directory (a leftover attempt is dropped)."""
    staging = spec.staging_dir(tag)
    storage.delete_tree(staging)
    if spec.begin_marker is not None:
        storage.write_bytes(f"{staging}/{spec.begin_marker}", b"1")


def swap_in_resave(storage: Storage, tag: str, spec: CommitLayout = NXD_COMMIT) -> None:
    """Rank 0, after the save of ``tag`` is complete (with a durable marker) in its staging directory:
    give it the tag's name. Also finishes a swap a crash interrupted."""
    staging, old = spec.staging_dir(tag), spec.replaced_dir(tag)
    if not storage.exists(f"{staging}/{spec.marker}"):
        raise CheckpointError(f"{storage.url}/{staging} is not complete; refusing to swap it in as {tag!r}")
    if spec.own_files is not None:
        _carry_foreign_files(storage, tag, staging, spec.own_files)
    if storage.renames_dirs:
        # Exchanged: the hidden directory holds the old copy (older by its creation time, which is how recovery
        # tells the two apart if a crash comes before the deletion). Two renames: between them the tag is missing
        # (a load or save finishes the swap).
        replace_dir(storage, staging, tag, old, spec.marker)
        return
    # No directory rename (object stores): the complete copy in ``staging`` is what a crash from here keeps.
    storage.delete(f"{tag}/{spec.marker}")
    storage.delete_tree(tag)
    files = [p for p in storage.walk_files(staging) if p != f"{staging}/{spec.marker}"]
    for path in files:
        storage.write_bytes(tag + path[len(staging) :], storage.read_bytes(path))
    storage.sync_dirs({tag + p[len(staging) :].rsplit("/", 1)[0] for p in files} | {tag, ""})
    storage.write_bytes(f"{tag}/{spec.marker}", storage.read_bytes(f"{staging}/{spec.marker}"))
    storage.sync_dirs([tag])
    delete_copy(storage, staging, spec.marker)


def _carry_foreign_files(storage: Storage, tag: str, staging: str, own_files: tuple[str, ...]) -> None:
    """Files others keep in the tag folder itself (optimum-neuron's ``mp_metadata_pp_rank_*.json``, which its
    PEFT save writes before saving and its async save right after) go with the re-saved copy unless it has its own."""
    owned = set(own_files)
    for path in storage.walk_files(tag):
        name = path[len(tag) + 1 :]
        if "/" in name or name in owned or storage.exists(f"{staging}/{name}"):
            continue
        storage.write_bytes(f"{staging}/{name}", storage.read_bytes(path))
        storage.sync_dirs([staging])


def _is_older_copy(storage: Storage, directory: str, tag: str, spec: CommitLayout) -> bool:
    """Whether the complete checkpoint in ``directory`` is older than the complete ``tag`` (so it is the old copy
    an exchange put there, not a re-save waiting to be swapped in); undated copies: whenever ``tag`` is complete."""
    if not storage.exists(f"{tag}/{spec.marker}"):
        return False
    if not spec.dated:
        return True
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
                recover_resave(storage, tag, NXD_COMMIT, finish_only)
                touched.append(tag)
    return touched


def recover_resave(storage: Storage, tag: str, spec: CommitLayout, finish_only: bool = False) -> None:
    """Rank 0: finish or undo the save of ``tag`` a crash interrupted (see above; ``finish_only``: as
    ``recover_resaves``); a hidden directory left empty is removed too."""
    _adopt_legacy_names(storage, tag, spec)
    staging, old, marker = spec.staging_dir(tag), spec.replaced_dir(tag), spec.marker
    if storage.exists(f"{staging}/{marker}") and not _is_older_copy(storage, staging, tag, spec):
        logger.warning("finishing the interrupted re-save of checkpoint %s in %s", tag, storage.url)
        swap_in_resave(storage, tag, spec)
        return
    if storage.exists(f"{staging}/{marker}"):  # the old copy an exchange left: delete it
        if not finish_only:
            delete_copy(storage, staging, marker)
        return
    if finish_only:
        if not storage.list_dir(tag) and storage.exists(f"{old}/{marker}"):
            _restore(storage, tag, old)
        return
    if storage.list_dir(staging):
        logger.warning("dropping the unfinished re-save of checkpoint %s in %s (the old one stays)", tag, storage.url)
    storage.delete_tree(staging)
    if not storage.list_dir(old):
        storage.delete_tree(old)
        return
    if storage.exists(f"{tag}/{marker}") or not storage.exists(f"{old}/{marker}"):
        delete_copy(storage, old, marker)
        return
    _restore(storage, tag, old)


def _adopt_legacy_names(storage: Storage, tag: str, spec: CommitLayout) -> None:
    """Rank 0: hidden copies of ``tag`` under the names an earlier version wrote take today's names (where those
    are free), so the recovery below settles them too."""
    legacy = spec.legacy_dirs(tag)
    if legacy is None or not storage.renames_dirs:
        return
    for old_name, name in zip(legacy, (spec.staging_dir(tag), spec.replaced_dir(tag)), strict=True):
        if storage.list_dir(old_name) and not storage.list_dir(name):
            storage.rename_dir(old_name, name)
            storage.sync_dirs([""])


def finish_swap(storage: Storage, tag: str, spec: CommitLayout) -> bool:
    """Give ``tag`` back its complete checkpoint where a crash between the two renames of a swap (storage without
    an atomic exchange: Lustre, NFS) left it missing: the complete staged copy takes the name (the old copy is then
    deleted), else the complete old copy goes back. True when ``tag`` is complete afterwards.

    Safe on several ranks at once (a reader on every rank finding the folder missing): each repair is one rename,
    a rank whose rename lost the race finds ``tag`` complete, and only the rank whose rename won deletes the old
    copy. An incomplete staged copy (a save that may still be running) is never touched."""
    marker = spec.marker
    if storage.exists(f"{tag}/{marker}"):
        return True
    if not storage.renames_dirs:
        return False  # folders are written in place there: nothing is ever swapped out
    if storage.list_dir(tag):  # a folder that is there (another rank's repair just now, or a partial one)
        return storage.exists(f"{tag}/{marker}")
    legacy = spec.legacy_dirs(tag) or ()
    staged = [spec.staging_dir(tag), *legacy[:1]]
    replaced = [spec.replaced_dir(tag), *legacy[1:]]
    for source in staged + replaced:
        if not storage.exists(f"{source}/{marker}"):
            continue
        try:
            storage.rename_dir(source, tag)
        except StorageError:  # another rank's rename came first (or the copy went meanwhile)
            if storage.exists(f"{tag}/{marker}"):
                return True
            continue
        storage.sync_dirs([""])
        logger.warning(
            "finished the interrupted swap of checkpoint %s in %s: it holds the %s copy",
            tag,
            storage.url,
            "new" if source in staged else "old",
        )
        if source in staged:
            for other in replaced:
                delete_copy(storage, other, marker)
        return True
    return storage.exists(f"{tag}/{marker}")


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
