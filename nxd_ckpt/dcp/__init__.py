"""torch.distributed.checkpoint (DCP) storage with the library's guarantees: ``StorageWriter`` and ``StorageReader``
write and read stock DCP checkpoints with per-rank checksums, a crash-safe commit and deadlines; ``Stager`` stages
``dcp.async_save`` through the device snapshot and reused host buffers (docs/torchtitan.md).

Importing this package imports ``torch.distributed.checkpoint``; ``import nxd_ckpt`` does not.
"""

from __future__ import annotations

from nxd_ckpt.dcp.contents import DcpDescription, describe, verify
from nxd_ckpt.dcp.place import CheckpointPlace
from nxd_ckpt.dcp.reader import StorageReader
from nxd_ckpt.dcp.stager import Stager, StageReport
from nxd_ckpt.dcp.writer import StorageWriter
from nxd_ckpt.format.layout import DCP_COMMIT
from nxd_ckpt.save import commit

__all__ = [
    "DcpDescription",
    "StageReport",
    "Stager",
    "StorageReader",
    "StorageWriter",
    "describe",
    "recover_folder",
    "verify",
]


def recover_folder(path: str) -> None:
    """Settle what a killed save left beside the checkpoint folder ``path`` (the next save into it does this too):
    a complete save waiting beside an incomplete folder takes its name, else an older checkpoint whose replacement
    never arrived gets its name back; hidden copies are deleted. A complete folder stays."""
    place = CheckpointPlace.of(path)
    commit.recover_folder(place.root, place.folder, DCP_COMMIT)
