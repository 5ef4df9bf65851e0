"""Retention: which tags a policy no longer keeps (a pure value), and the one way tags are deleted.

``KeepLatest(n)`` is what ``num_kept_ckpts`` builds (``SaveOptions.retention``): given the tags in
``tags.list_tags``' order it names those to delete, and decides nothing else. ``delete_tags`` is every deletion of
a tag: a save's retention (``apply_retention``, rank 0, on the writer thread), ``CheckpointManager.remove_tags``
(NxD's ``g_iostate.submit_remove``, Lightning's ``remove_checkpoint``), ``nxd-ckpt prune``. Each tag loses
``done`` first (made durable), then everything else, so a crash mid-deletion never leaves a tag that looks
complete.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.tags import TagInfo
from nxd_ckpt.storage import Storage

logger = logging.getLogger("nxd_ckpt")


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``n`` complete tags: older complete tags go, and interrupted saves surely older than the
    oldest one kept. ``n`` None (or NxD's -1) keeps every complete tag: only interrupted leftovers older than all
    of them go."""

    n: int | None = None

    def __post_init__(self) -> None:
        """The one rule for ``num_kept_ckpts``: None, -1 (stored as None) or an integer >= 1."""
        n = self.n
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < -1 or n == 0):
            raise ValueError(f"num_kept_ckpts must be None or -1 (keep all, as in NxD) or an integer >= 1, got {n!r}")
        if n == -1:
            object.__setattr__(self, "n", None)

    @property
    def keeps_all(self) -> bool:
        """Whether every complete tag is kept (``num_kept_ckpts`` None or -1: a save runs no retention)."""
        return self.n is None

    def to_delete(self, infos: Sequence[TagInfo], protect: Collection[str] = frozenset()) -> list[str]:
        """The tags to delete (pure): complete ones beyond the newest ``n``, oldest first, then incomplete ones
        surely older than the oldest kept complete one. Tags in ``protect`` (saves in flight) are never chosen."""
        ordered = sorted(infos, key=lambda i: i.sort_key)
        complete = [t for t in ordered if t.complete]
        keep = max(1, len(complete)) if self.n is None else self.n
        doomed = [t.name for t in complete[: max(0, len(complete) - keep)]]
        kept = complete[-keep:] if complete else []
        if kept:
            doomed += [t.name for t in ordered if not t.complete and t.surely_before(kept[0])]
        return [name for name in doomed if name not in protect]


def apply_retention(storage: Storage, policy: KeepLatest | None, protect: Collection[str] = frozenset()) -> list[str]:
    """Delete the tags of ``storage`` that ``policy`` no longer keeps (never those in ``protect``); None keeps
    all. Returns the tags deleted; a failed deletion is logged, not raised (it must not stop training)."""
    if policy is None:
        return []
    deleted = delete_tags(storage, policy.to_delete(tags.list_tags(storage, include_incomplete=True), protect))
    if deleted:
        logger.info("retention deleted %s", ", ".join(deleted))
    return deleted


def delete_tags(storage: Storage, names: Iterable[str], *, strict: bool = False) -> list[str]:
    """Delete the tags ``names`` of ``storage`` that exist, each ``done`` first; returns those deleted. A failure
    (an invalid name included) is logged and the next tag deleted, or, ``strict``, raised at once."""
    deleted = []
    for name in names:
        try:
            if _exists(storage, name):
                _delete_tag(storage, name)
                deleted.append(name)
        except Exception as e:
            if strict:
                raise
            logger.warning("could not delete checkpoint %s in %s: %s", name, storage.url, e)
    return deleted


def _exists(storage: Storage, tag: str) -> bool:
    """Whether ``tag`` is there to delete; a symbolic link counts even when what it names is gone."""
    local = storage.local_path(layout.validate_tag(tag))
    return os.path.lexists(local) if local is not None else storage.exists(tag)


def _delete_tag(storage: Storage, tag: str) -> None:
    """Delete one tag: ``done`` first, durably (so it stops counting as complete), then everything else. A tag that
    is a symbolic link (Lightning's ``ModelCheckpoint(save_last="link")``) is unlinked; the tag it names is kept."""
    local = storage.local_path(layout.validate_tag(tag))
    if local is not None and os.path.islink(local):
        storage.delete(tag)
        return
    storage.delete(layout.tag_path(tag, layout.DONE_MARKER))
    storage.sync_dirs([tag])
    storage.delete_tree(tag)
