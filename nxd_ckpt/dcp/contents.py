"""What a DCP checkpoint folder holds, and whether its files are intact, read offline (the command's ``inspect`` and
``verify``; ``nxd_ckpt.dcp.describe`` / ``nxd_ckpt.dcp.verify``).

A folder ``StorageWriter`` wrote is verified as the library's own tags are: ``.metadata`` and every rank file
against the manifests (size and xxh3_64), every byte ``.metadata`` points at covered by a listed file. A folder stock
DCP wrote has no checksums: ``verify`` checks that ``.metadata`` unpickles and that every file it points into holds
the bytes it points at, and says in a note that the contents were not checked.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from typing import Any

from nxd_ckpt.dcp.place import METADATA, CheckpointPlace
from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.manifests import FileRecord, check_record, read_manifests
from nxd_ckpt.tools.dcp_io import unpickle_metadata
from nxd_ckpt.tools.verification import VerifyReport

NO_CHECKSUMS = (
    "written without nxd_ckpt manifests (stock DCP, or its nxd_ckpt/ folder is gone): only sizes were checked "
    "against .metadata; the contents could not be verified (DCP records no checksums)"
)


@dataclass(frozen=True)
class DcpEntry:
    """One entry of DCP's ``.metadata``: a tensor (global shape, chunks saved) or a pickled object."""

    fqn: str
    kind: str
    """``tensor`` or ``bytes``."""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: int = 0
    nbytes: int = 0
    """Bytes stored for it (the sum of its items' lengths in the files)."""


@dataclass
class DcpDescription:
    """A DCP checkpoint folder: its entries, files and whether the library's manifests cover it."""

    path: str
    entries: list[DcpEntry] = field(default_factory=list)
    files: list[tuple[str, int]] = field(default_factory=list)
    manifests: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": "dcp",
            "manifests": self.manifests,
            "files": [{"path": p, "size": s} for p, s in self.files],
            "entries": [e.__dict__ | {"shape": list(e.shape) if e.shape is not None else None} for e in self.entries],
        }


def _metadata(place: CheckpointPlace, allow_pickle: bool) -> Any:
    """DCP's ``Metadata`` of the folder (FileNotFoundError without one)."""
    where = f"{place.root.url}/{place.folder}/{METADATA}"
    data = place.root.read_bytes(f"{place.folder}/{METADATA}")
    return unpickle_metadata(io.BytesIO(data), where, allow_pickle=allow_pickle)


def describe(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> DcpDescription:
    """The entries and files of the DCP checkpoint folder ``path`` (``.metadata`` unpickled with torch's classes
    only unless ``allow_pickle``)."""
    place = CheckpointPlace.of(path)
    metadata = _metadata(place, allow_pickle)
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    out = DcpDescription(place.path, manifests=len(read_manifests(place.root, place.folder).ranks))
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if hasattr(md, "chunks"):
            out.entries.append(
                DcpEntry(fqn, "tensor", str(md.properties.dtype).removeprefix("torch."), tuple(md.size),
                         len(md.chunks), stored.get(fqn, 0))
            )  # fmt: skip
        else:
            out.entries.append(DcpEntry(fqn, "bytes", nbytes=stored.get(fqn, 0)))
    root, folder = place.root, place.folder
    out.files = [(p[len(folder) + 1 :], root.size(p)) for p in sorted(root.walk_files(folder))]
    return out


def verify(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> VerifyReport:
    """Check the DCP checkpoint folder ``path``: against the manifests where it has them, else sizes only (a note
    says so). Problems name their file; nothing raises for a damaged checkpoint."""
    start = time.perf_counter()
    place = CheckpointPlace.of(path)
    root, folder = place.root, place.folder
    report = VerifyReport(checkpoint_dir=root.url, tag=folder)
    if not place.is_complete():
        report.problems.append(f"{root.url}/{folder} has no {METADATA}: it is not a complete DCP checkpoint")
        return report
    report.complete = True
    found = read_manifests(root, folder)
    report.problems += [str(p) for p in found.problems]
    report.manifests = len(found.ranks)
    try:
        metadata = _metadata(place, allow_pickle)
    except Exception as e:
        report.problems.append(f"{root.url}/{folder}/{METADATA} cannot be read ({type(e).__name__}: {e})")
        metadata = None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values() if metadata is not None else ():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if found.index:
        _check_listed(place, found.index, needed, report)
    else:
        _check_sizes(place, needed, report)
        report.notes.append(NO_CHECKSUMS)
    report.seconds = time.perf_counter() - start
    return report


def _check_listed(
    place: CheckpointPlace, index: dict[str, FileRecord], needed: dict[str, int], report: VerifyReport
) -> None:
    """Every listed file against its record; every byte ``.metadata`` points at inside a listed file."""
    root, folder = place.root, place.folder
    for rel, rec in sorted(index.items()):
        full = f"{folder}/{rel}"
        try:
            data = root.read_buffer(full)
            check_record(root.url, folder, full, rec, *hash_bytes(data))
        except FileNotFoundError:
            report.problems.append(f"{root.url}/{full} is missing (listed in rank {rec.rank}'s manifest)")
            continue
        except IntegrityError as e:
            report.problems.append(str(e))
        report.files_checked += 1
        report.bytes_checked += rec.size
    for rel, end in sorted(needed.items()):
        rec = index.get(rel)
        if rec is None or rec.size < end:
            state = "no manifest lists it" if rec is None else f"its record has {rec.size} of {end} bytes"
            report.problems.append(f"{root.url}/{folder}/{rel} is pointed at by {METADATA} but {state}")


def _check_sizes(place: CheckpointPlace, needed: dict[str, int], report: VerifyReport) -> None:
    """A checkpoint without manifests: each file ``.metadata`` points into exists and holds the bytes it points at."""
    root, folder = place.root, place.folder
    for rel, end in sorted(needed.items()):
        full = f"{folder}/{rel}"
        if not root.exists(full):
            report.problems.append(f"{root.url}/{full} is missing ({METADATA} points into it)")
            continue
        size = root.size(full)
        if size < end:
            report.problems.append(
                f"{root.url}/{full} is truncated: {METADATA} points at bytes up to {end} but it has {size}"
            )
        report.files_checked += 1
    report.files_checked += 1  # .metadata itself, unpickled
