"""Where a DCP checkpoint folder lives, and how a save of it is staged, committed and recovered.

A folder ``.../step-10`` is the checkpoint ``step-10`` (a tag name) in the storage of its parent, so the library's
storage (local or ``s3://``), re-save swap and manifests work on it unchanged. On storage that renames directories
(a POSIX filesystem) a save is written into the hidden sibling ``layout.dcp_staging_dir(folder)`` and committed by
renaming it into place (``tags.replace_dir``: one atomic exchange with an older copy where the filesystem has it):
a stock reader sees the old checkpoint or the new one, never a mixture. Elsewhere (object stores) the folder is
written in place, ``.metadata`` last, and a folder that already holds a complete checkpoint is refused.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from nxd_ckpt.errors import CheckpointError, InvalidTagError
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.manifests import FileRecord, manifest_bytes, parse_manifest
from nxd_ckpt.storage import Storage, storage_for
from nxd_ckpt.watchdog import StorageMonitor, WatchedStorage

METADATA = layout.DCP_METADATA_FILE
"""DCP's own index of a checkpoint: the file whose presence makes a folder a checkpoint for DCP and TorchTitan."""


@dataclass(frozen=True)
class CheckpointPlace:
    """A DCP checkpoint folder: the storage of its parent (``root``) and its name there (``folder``)."""

    root: Storage
    folder: str
    path: str
    """The folder as the caller named it (a local path or an ``s3://`` URL)."""

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> CheckpointPlace:
        """The place of the checkpoint folder ``path``; InvalidTagError if its name cannot be a folder name."""
        url = os.fspath(path)
        if "://" in url:
            parent, _, name = url.rstrip("/").rpartition("/")
        else:
            parent, name = os.path.split(os.path.abspath(url))
        try:
            layout.validate_tag(name)
        except InvalidTagError as e:
            raise InvalidTagError(
                f"DCP checkpoint folder {url!r}: its name {name!r} is not a plain folder name (letters, digits and "
                ". _ - + = @, not starting with a dot); choose a folder like 'step-100'"
            ) from e
        return cls(storage_for(parent), name, url)

    def watched(self, monitor: StorageMonitor) -> CheckpointPlace:
        """The same place with every storage call reported to ``monitor`` (the writer's deadline)."""
        return dataclasses.replace(self, root=WatchedStorage(self.root, monitor))

    @property
    def staging(self) -> str:
        """The directory a save writes into: the hidden sibling where the root renames directories, else the folder."""
        return layout.dcp_staging_dir(self.folder) if self.root.renames_dirs else self.folder

    def staged(self) -> Storage:
        """The root storage with the folder's paths sent to the staging directory: every writer names files by the
        folder, as they are once committed."""
        if self.staging == self.folder:
            return self.root
        return tags.ResaveStorage(self.root, self.folder, self.staging)

    def is_complete(self, directory: str | None = None) -> bool:
        """Whether ``directory`` (default: the folder) holds DCP's ``.metadata``."""
        return self.root.exists(f"{directory or self.folder}/{METADATA}")

    def begin(self) -> None:
        """Coordinator, before any rank writes: settle an interrupted save of this folder, then start from an empty
        staging directory (where the folder is written in place, refuse to overwrite a complete checkpoint)."""
        recover(self)
        if self.staging == self.folder and self.is_complete():
            raise CheckpointError(
                f"{self.path} already holds a complete DCP checkpoint and {self.root.url} cannot rename directories, "
                "so overwriting it could lose it if the save fails; save to a new folder or delete the old one first"
            )
        self.root.delete_tree(self.staging)

    def commit(self, metadata: bytes, world_size: int, coordinator: int, needed: dict[str, int]) -> None:
        """Coordinator, after every rank's ``write_data``: check that each rank's manifest is there and covers the
        bytes the metadata points at (``needed``: file -> end of its last item), record ``.metadata`` in the
        coordinator's manifest, write ``.metadata`` last (atomically, durably), then rename the staging directory
        into place."""
        staged = self.staged()
        records = self._rank_records(staged, world_size)
        for rel, end in sorted(needed.items()):
            rec = records.get(rel)
            if rec is None or rec.size < end:
                state = "no manifest lists it" if rec is None else f"{rec.size} of {end} bytes"
                raise CheckpointError(
                    f"{self.path}: {rel} is not recorded as written ({state}); the save is not committed and the "
                    "previous checkpoint stays; save again"
                )
        own = {rel: rec for rel, rec in records.items() if rec.rank == coordinator}
        own[METADATA] = FileRecord(*hash_bytes(metadata), coordinator)
        manifest = layout.manifest_file(self.folder, coordinator)
        staged.write_bytes(manifest, manifest_bytes(self.folder, coordinator, own))
        staged.write_bytes(f"{self.folder}/{METADATA}", metadata)
        staged.sync_dirs([self.folder, manifest.rsplit("/", 1)[0]])
        if self.staging != self.folder:
            tags.replace_dir(self.root, self.staging, self.folder, layout.dcp_replaced_dir(self.folder), METADATA)

    def _rank_records(self, staged: Storage, world_size: int) -> dict[str, FileRecord]:
        """Every rank's manifest merged; CheckpointError naming the first rank whose manifest is missing."""
        records: dict[str, FileRecord] = {}
        for rank in range(world_size):
            path = layout.manifest_file(self.folder, rank)
            if not staged.exists(path):
                raise CheckpointError(
                    f"{self.path}: rank {rank} has no manifest ({path}), so its files are not known to be durable; "
                    "the save is not committed and the previous checkpoint stays; save again"
                )
            records.update(parse_manifest(staged.read_bytes(path), f"{staged.url}/{path}")[1])
        return records


def recover(place: CheckpointPlace) -> None:
    """Settle what a killed save of ``place`` left: an older copy whose replacement never got the folder's name goes
    back; every hidden staging or replaced copy is deleted (``.metadata`` first). The folder itself is never touched
    when it is complete."""
    root, folder = place.root, place.folder
    if place.staging == folder:
        return
    replaced = layout.dcp_replaced_dir(folder)
    if not place.is_complete() and place.is_complete(replaced):
        root.delete_tree(folder)
        root.rename_dir(replaced, folder)
        root.sync_dirs([""])
    for hidden in (place.staging, replaced):
        tags.delete_copy(root, hidden, METADATA)
        root.delete_tree(hidden)  # one left empty too
