"""Structure checks that need no manifest: the state files a tag's layout implies, each one's pickled structure,
and, for xser, a tensor file for every reference.

The files a tag must hold come from ``format.describe.expected_files`` (the one owner, also used by ``verify``
and the loader), so a checkpoint written by NxD (no metadata, no manifests) is checked for completeness too.
Reading structure only touches pickles, never tensor data. ``nxd_ckpt.verify`` runs ``check_readable``;
``nxd-ckpt verify --quick`` runs ``check_structure`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from nxd_ckpt.errors import CheckpointError, UnsafeCheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import expected_files
from nxd_ckpt.inspection import Checkpoint

__all__ = ["Checkpoint", "Problem", "check_readable", "check_structure", "implied_state_files"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the file (relative to the checkpoint directory) it concerns."""

    path: str
    message: str


def implied_state_files(ckpt: Checkpoint) -> list[str]:
    """State files the tag's layout needs (``format.describe.expected_files``), relative to the checkpoint
    directory."""
    return [layout.tag_path(ckpt.tag, *rel.split("/")) for rel in expected_files(ckpt.description())]


def check_structure(ckpt: Checkpoint) -> list[Problem]:
    """Problems with a tag's structure: ``done`` missing, state files the layout implies missing, state files
    whose structure cannot be read, xser references without their tensor file."""
    problems: list[Problem] = []
    if not ckpt.complete:
        done = layout.tag_path(ckpt.tag, layout.DONE_MARKER)
        problems.append(Problem(done, "missing: the save did not finish (or the tag was being deleted)"))
    for path in implied_state_files(ckpt):
        if not ckpt.storage.exists(path):
            problems.append(Problem(path, "missing: the layout of this tag implies it"))
    return problems + check_readable(ckpt)


def check_readable(ckpt: Checkpoint) -> list[Problem]:
    """State files whose structure cannot be read, and xser references without their tensor file."""
    problems: list[Problem] = []
    for sf in ckpt.state_files():
        try:
            objects = ckpt.objects(sf)
        except UnsafeCheckpointError:
            continue  # refused for safety, not damaged (verify notes the classes it would need)
        except (CheckpointError, KeyError, OSError) as e:
            problems.append(Problem(sf.path, f"unreadable: {_without_location(str(e), ckpt, sf.path)}"))
            continue
        if sf.encoding == "xser":
            tensor_files = {o.file for o in objects if o.kind == "tensor"}
            for missing in sorted(p for p in tensor_files if not ckpt.storage.exists(p)):
                problems.append(Problem(missing, f"missing: {sf.path} refers to it"))
    return problems


def _without_location(message: str, ckpt: Checkpoint, path: str) -> str:
    """An error message without its leading file location (the Problem names the file already)."""
    location = f"{ckpt.storage.url}/{path}"
    return message[len(location) :].lstrip(" :") if message.startswith(location) else message
