"""Structure checks that need no manifest: the state files an NxD layout implies, each one's pickled structure,
and, for xser, a tensor file for every reference.

``nxd_ckpt.verification.verify`` checks bytes (recorded checksums, zip CRCs) and the files nxd_ckpt's metadata
lists; these checks add what the files themselves imply, so a checkpoint written by NxD (no metadata, no
manifests) is checked for completeness too. Reading structure only touches pickles, never tensor data.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout
from .errors import CheckpointError
from .inspect import Checkpoint


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the file (relative to the checkpoint directory) it concerns."""

    path: str
    message: str


def implied_state_files(ckpt: Checkpoint) -> list[str]:
    """State files the layout needs, inferred from the file names present (every (TP, PP) coordinate of the
    grid they span; every DP rank for ZeRO-1). Paths are relative to the checkpoint directory."""
    lay = ckpt.layout()
    if lay.tp is None or lay.pp is None:
        return []
    present = {sf.path for sf in ckpt.state_files()}
    eps: list[int | None] = list(range(lay.ep)) if lay.ep > 1 else [None]  # EP ranks are in model file names
    grid = [(tp, pp, ep) for pp in range(lay.pp) for tp in range(lay.tp) for ep in eps]
    tag = ckpt.tag
    out: list[str] = []
    if any(layout.model_file(tag, tp, pp, ep) in present for tp, pp, ep in grid):
        out += [layout.model_file(tag, tp, pp, ep) for tp, pp, ep in grid]
    if lay.zero1:  # ZeRO-1 shards are named without the EP rank (their DP rank already tells them apart)
        zgrid = {(tp, pp) for tp, pp, _ in grid}
        if any(layout.optim_file(tag, dp, tp, pp) in present for dp in range(lay.dp or 1) for tp, pp in zgrid):
            dps = range(lay.dp or 1)
            out += [layout.optim_file(tag, dp, tp, pp) for dp in dps for tp, pp in sorted(zgrid, key=lambda c: c[::-1])]
    elif any(layout.optim_file(tag, 0, tp, pp, ep) in present for tp, pp, ep in grid):
        out += [layout.optim_file(tag, 0, tp, pp, ep) for tp, pp, ep in grid]
    return out


def check_structure(ckpt: Checkpoint) -> list[Problem]:
    """Problems with a tag's structure: ``done`` missing, state files the layout implies missing, state files
    whose structure cannot be read, xser references without their tensor file."""
    problems: list[Problem] = []
    if not ckpt.complete:
        done = layout.tag_path(ckpt.tag, layout.DONE_MARKER)
        problems.append(Problem(done, "missing: the save did not finish (or the tag was being deleted)"))
    present = {sf.path for sf in ckpt.state_files()}
    for path in implied_state_files(ckpt):
        if path not in present:
            problems.append(Problem(path, "missing: the other state files of this tag imply it"))
    for sf in ckpt.state_files():
        try:
            objects = ckpt.objects(sf)
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
