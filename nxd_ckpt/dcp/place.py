"""Where a DCP checkpoint folder lives, and what the writer and reader both say about it.

A folder ``.../step-10`` is the checkpoint ``step-10`` (a tag name) in the storage of its parent, so the library's
storage (local or ``s3://``), commit (``save.commit`` with ``layout.DCP_COMMIT``: staged in a hidden sibling where
the storage renames directories, ``.metadata`` last, swapped in whole) and manifests work on it unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from nxd_ckpt.errors import InvalidTagError
from nxd_ckpt.format import layout, resave
from nxd_ckpt.save import commit
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
    def is_staged(self) -> bool:
        """Whether a save is written in the folder's hidden staging directory and swapped in (the root renames
        directories: ``commit.prepare_folder`` decides the same), rather than in place."""
        return self.root.renames_dirs

    def staged(self) -> Storage:
        """The storage every rank writes a save through: the staging directory under the folder's names, or the
        root itself."""
        return commit.staged_storage(self.root, self.folder, self.is_staged, layout.DCP_COMMIT)

    def is_complete(self) -> bool:
        """Whether the folder holds DCP's ``.metadata``."""
        return self.root.exists(f"{self.folder}/{METADATA}")

    def repair(self) -> bool:
        """Give the folder back the complete checkpoint a save killed between its two renames (storage without an
        atomic exchange) left under a hidden name: the new copy if it was complete, else the old one. Safe on
        every rank at once; an unfinished save is left alone. True when the folder is complete afterwards."""
        return resave.finish_swap(self.root, self.folder, layout.DCP_COMMIT)


class FolderId:
    """What DCP's ``StorageWriter`` and ``StorageReader`` both say about their ``checkpoint_id``: the folder
    ``path``, a local path or an ``s3://`` URL; and how either one is pickled (DCP's
    ``AsyncCheckpointerType.PROCESS`` executor sends the writer to its checkpoint process)."""

    path: str
    place: CheckpointPlace

    _PER_PROCESS: tuple[str, ...] = ("place",)
    """Attributes that belong to this process (open storage clients, the memory tier's runtime): not pickled;
    a copy opens the folder's storage again, the others start as None."""

    def __getstate__(self) -> dict[str, object]:
        """The settings and the ids of the save or load in hand; never what belongs to this process. A memory tier
        is refused: its copies, file server and save count live in this process's runtime."""
        if getattr(self, "memory_tier", None) is not None:
            raise TypeError(
                f"nxd_ckpt.dcp.{type(self).__name__}({self.path!r}, memory_tier=...) cannot be pickled: the memory "
                "tier lives in this process (its node's copies, file server and save count), and DCP's "
                "AsyncCheckpointerType.PROCESS executor would save from another one; use "
                "async_checkpointer_type=AsyncCheckpointerType.THREAD (the default) with a memory tier, or no "
                "memory_tier with PROCESS"
            )
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        for name in self._PER_PROCESS:
            setattr(self, name, None)
        self.place = CheckpointPlace.of(self.path)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A local path or an ``s3://`` URL."""
        url = os.fspath(checkpoint_id)
        return url.startswith("s3://") or "://" not in url
