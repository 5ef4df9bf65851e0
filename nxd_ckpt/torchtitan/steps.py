"""TorchTitan's checkpoint folder: ``step-N`` folders under ``checkpoint.folder``, which of them are checkpoints,
and retention over them through the library's retention policy (``format.retention.KeepLatest``).

A folder counts as a checkpoint when its name is exactly ``step-N`` and it holds DCP's ``.metadata``, which
``nxd_ckpt.dcp.StorageWriter`` writes last and TorchTitan's own manager looks for too. The writer's hidden siblings
(``.nxd-dcp-staging.step~N``, ``.nxd-dcp-replaced.step~N``: ``layout.DCP_COMMIT``) never count, here or in
TorchTitan's own scan (``re.search(r"step-(\\d+)")``, which the hidden names do not match). ``repair`` gives a step
back the checkpoint a save killed between its two renames left hidden (storage without an atomic exchange);
retention deletes hidden siblings older than the oldest step it keeps.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from nxd_ckpt.dcp.place import METADATA, CheckpointPlace
from nxd_ckpt.format import tags
from nxd_ckpt.format.layout import DCP_COMMIT, HF_COMMIT
from nxd_ckpt.format.retention import KeepLatest
from nxd_ckpt.format.tags import TagInfo
from nxd_ckpt.storage import Storage, storage_for

logger = logging.getLogger("nxd_ckpt")

_STEP_NAME = re.compile(r"step-(\d+)")


def step_name(step: int) -> str:
    """The folder name of ``step``'s checkpoint, as TorchTitan names it."""
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    """The step of the folder ``name`` (``step-N``), None for any other name."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class StepFolders:
    """The ``step-N`` folders of one TorchTitan checkpoint folder (a local path or an ``s3://`` URL)."""

    folder: str
    storage: Storage

    @classmethod
    def of(cls, folder: str) -> StepFolders:
        """The step folders under ``folder`` (which need not exist yet)."""
        return cls(folder.rstrip("/"), storage_for(folder))

    def path(self, step: int) -> str:
        """The checkpoint folder of ``step`` (what DCP gets as ``checkpoint_id``)."""
        return f"{self.folder}/{step_name(step)}"

    def exists(self) -> bool:
        """Whether the checkpoint folder is there (on an object store: whether anything is under it)."""
        return self.storage.exists("") or bool(self.storage.list_dir(""))

    def steps(self) -> dict[int, bool]:
        """Every ``step-N`` folder: step -> whether it is complete (holds ``.metadata``)."""
        found = {}
        for name in self.storage.list_dir(""):
            step = parse_step(name)
            if step is not None:
                found[step] = self.storage.exists(f"{name}/{METADATA}")
        return found

    def complete_steps(self) -> list[int]:
        """The steps holding a complete checkpoint, oldest first."""
        return sorted(step for step, complete in self.steps().items() if complete)

    def hidden(self) -> dict[str, int]:
        """The hidden siblings of step folders a save leaves (DCP's and the Hugging Face last step's staging and
        replaced copies, today's names and earlier versions'): name -> step."""
        found = {}
        for name in self.storage.list_dir(""):
            folder = DCP_COMMIT.folder_of(name) or HF_COMMIT.folder_of(name)
            step = parse_step(folder) if folder is not None else None
            if step is not None:
                found[name] = step
        return found

    def repair(self) -> list[int]:
        """Rank 0, before the steps are listed: each step whose folder a save killed between its two renames left
        missing gets its complete checkpoint back (``CheckpointPlace.repair``: the new copy, else the old one).
        Unfinished saves are left alone (retention deletes them once older than every step kept). Returns the
        steps repaired."""
        repaired = []
        for step in sorted(set(self.hidden().values())):
            place = CheckpointPlace(self.storage, step_name(step), self.path(step))
            if not place.is_complete() and place.repair():
                repaired.append(step)
        return repaired

    def apply_retention(self, keep: int, protect: frozenset[int] = frozenset()) -> list[str]:
        """Keep the ``keep`` newest complete steps (``KeepLatest``: older complete steps go, and incomplete ones
        older than the oldest kept, hidden staging and replaced copies included); never the steps in ``protect``.
        Each goes ``.metadata`` first, durably, so a half-deleted step never counts as a checkpoint. Returns the
        folders deleted; a failure is logged."""
        steps = self.steps()
        infos = [TagInfo(step_name(s), complete, float(s), None) for s, complete in steps.items()]
        doomed = KeepLatest(keep).to_delete(infos, frozenset(step_name(s) for s in protect))
        kept = sorted(s for s, complete in steps.items() if complete)[-keep:]
        if kept:
            doomed += [n for n, s in sorted(self.hidden().items()) if s < kept[0] and s not in protect]
        deleted = []
        for name in doomed:
            try:
                tags.delete_copy(self.storage, name, METADATA)
                self.storage.delete_tree(name)  # a folder emptied by an earlier, interrupted deletion
                deleted.append(name)
            except Exception as e:
                logger.warning("could not delete checkpoint %s in %s: %s", name, self.folder, e)
        if deleted:
            logger.info("retention (keep_latest_k=%d) deleted %s", keep, ", ".join(deleted))
        return deleted
