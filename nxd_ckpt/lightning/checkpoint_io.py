"""``NxdCheckpointIOBase``: the Lightning-independent part of ``NxdCheckpointIO`` (Lightning's ``CheckpointIO``
surface over the process-wide manager: save, load and remove one checkpoint as an nxd_ckpt tag)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from nxd_ckpt import api
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.describe import describe
from nxd_ckpt.lightning.mapping import checkpoint_location, split_checkpoint, zero1_from_config
from nxd_ckpt.lightning.package import lightning_package
from nxd_ckpt.options import LoadOptions, SaveOptions
from nxd_ckpt.ranks import coordinator
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.storage import Storage

logger = logging.getLogger("nxd_ckpt")


class NxdCheckpointIOBase:
    """The Lightning-independent part of ``NxdCheckpointIO`` (the class Lightning sees adds its ``CheckpointIO``)."""

    def __init__(
        self,
        use_xser: bool = True,
        async_save: bool = False,
        *,
        weight_init_only: bool = False,
        zero1: bool | None = None,
        strip_version_suffix: bool = True,
        allow_pickle: bool = False,
        num_workers: int = 8,
        save_options: Mapping[str, Any] | None = None,
        load_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``use_xser``/``async_save``: as in ``nxd_ckpt.save_checkpoint``. ``weight_init_only``: loads read the
        model only (no ``optimizer_states``), as NxDT's option. ``zero1``: ZeRO-1 optimizer state; None takes it
        from the module's config (``hyper_parameters["cfg"]["wrap_with_zero"]``, as NxDT). ``save_options`` and
        ``load_options`` go to ``save_checkpoint``/``load_checkpoint`` as keywords (e.g. ``timeout``,
        ``save_rng``, ``memory_tier``)."""
        super().__init__()
        self.use_xser = use_xser
        self.async_save = async_save
        self.weight_init_only = weight_init_only
        self.zero1 = zero1
        self.strip_version_suffix = strip_version_suffix
        self.allow_pickle = allow_pickle
        self.num_workers = num_workers
        self.save_options = _checked_keywords(SaveOptions, save_options, _SAVE_KEYWORDS_SET_HERE, "save_options")
        self.load_options = _checked_keywords(LoadOptions, load_options, _LOAD_KEYWORDS_SET_HERE, "load_options")
        self._every_rank = False
        self.last_report: SaveReport | None = None
        """The report of this CheckpointIO's last save on this rank (time blocked, bytes, staging memory)."""
        self._holder: dict[tuple[str, str], str] = {}
        """(directory, tag) -> the Lightning path whose checkpoint the tag holds now (see ``remove_checkpoint``)."""

    def location(self, path: str | os.PathLike[str]) -> tuple[str, str]:
        """Lightning's path -> (checkpoint directory, tag); see ``checkpoint_location``."""
        return checkpoint_location(path, self.strip_version_suffix)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save Lightning's dict as the tag of ``path``; every rank must call it (``NxdDDPStrategy`` does)."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r}): pass nxd_ckpt options "
                "as NxdCheckpointIO(save_options={...})"
            )
        if not self._every_rank and coordinator.world_size() > 1:
            raise RuntimeError(
                f"{type(self).__name__}.save_checkpoint was called on one rank of {coordinator.world_size()}; an "
                "nxd_ckpt save is collective and Lightning's stock strategies save on global rank 0 only: use "
                "Trainer(strategy=NxdDDPStrategy()) (or NxdXLAStrategy), or call save_on_every_rank on every rank"
            )
        directory, tag = self.location(path)
        model, optimizer, content = split_checkpoint(checkpoint)
        zero1 = self.zero1 if self.zero1 is not None else zero1_from_config(content)
        options = SaveOptions(
            directory,
            tag,
            model=model,
            optimizer=optimizer,
            user_content=content,
            num_workers=self.num_workers,
            use_xser=self.use_xser,
            async_save=self.async_save,
            zero1_optimizer=zero1,
            **self.save_options,
        )
        self.last_report = api.get_manager().save(options)
        self._holder[(directory, tag)] = os.fspath(path)

    def save_on_every_rank(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """``save_checkpoint``, called by a strategy on every rank (``NxdDDPStrategy``, ``NxdXLAStrategy`` or
        your own). A plain ``save_checkpoint`` in a world of several ranks is refused: Lightning's stock
        strategies call it on global rank 0 only, and the save would wait for the other ranks until it timed out."""
        self._every_rank = True
        try:
            self.save_checkpoint(checkpoint, path, storage_options)
        finally:
            self._every_rank = False

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's dict rebuilt from the tag of ``path``: the user content plus ``state_dict`` and
        ``optimizer_states`` (loaded into empty dicts, CPU tensors that Lightning copies into the module and the
        optimizer). ``map_location`` and ``weights_only`` are not used: what may be unpickled is
        ``allow_pickle``'s decision."""
        directory, tag = self.location(path)
        manager = api.get_manager()
        storage = manager.storage(directory)
        tag = _through_link(storage, tag)
        model: dict[str, Any] = {}
        optimizer: dict[str, Any] | None = None
        if not self.weight_init_only and "optimizer" in describe(storage, tag).saved_items:
            optimizer = {}
        options = LoadOptions(
            directory, tag, model=model, optimizer=optimizer, allow_pickle=self.allow_pickle, **self.load_options
        )
        content = manager.load(options)
        checkpoint = dict(content) if isinstance(content, Mapping) else {}
        checkpoint["state_dict"] = model
        checkpoint.setdefault("pytorch-lightning_version", str(lightning_package().__version__))
        if optimizer is not None:
            checkpoint["optimizer_states"] = [optimizer]
        elif self.weight_init_only:
            checkpoint.pop("optimizer_states", None)
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the tag of ``path`` once every save submitted before is committed (``queue_removal``).

        A tag that now holds another Lightning path's checkpoint (``X-v1.ckpt`` saved again as tag ``X.ckpt``) is
        kept: Lightning removes ``X.ckpt`` meaning the older file, not the newer one that took its tag."""
        directory, tag = self.location(path)
        holder = self._holder.get((directory, tag))
        if holder is not None and holder != os.fspath(path):
            logger.info("not removing checkpoint %s in %s: it now holds %s", tag, directory, holder)
            return
        self._holder.pop((directory, tag), None)
        queue_removal(directory, tag)

    def teardown(self) -> None:
        """Wait for the last async save (raising its error, if it failed)."""
        api.finalize_checkpoint()


def _through_link(storage: Storage, tag: str) -> str:
    """The tag to load for ``tag``: itself, except for a symbolic link (``ModelCheckpoint(save_last="link")``)
    to a tag that is not complete. Lightning links ``last.ckpt`` to a checkpoint as soon as its save starts, so
    after a crash during an async save the link names an incomplete tag: "the newest checkpoint" is then the
    newest complete tag of the directory (logged)."""
    local = storage.local_path(tag)
    if local is None or not os.path.islink(local) or storage.exists(layout.tag_path(tag, layout.DONE_MARKER)):
        return tag
    newest = tags.latest_tag(storage)
    if newest is None:
        return tag  # the load names what is missing
    logger.warning(
        "%s links to %s, which is not complete (its save was interrupted); loading the newest complete "
        "checkpoint, %s, instead",
        tag,
        os.readlink(local),
        newest,
    )
    return newest


def queue_removal(checkpoint_dir: str | os.PathLike[str], tag: str) -> None:
    """Delete ``tag`` of ``checkpoint_dir`` behind every save this process has submitted, through the manager's
    storage (``CheckpointManager.remove_tags``: global rank 0 deletes, the other ranks do nothing). A save in
    flight is committed before its tag can be deleted, and the next save waits for the deletion, so a tag is never
    deleted while it is written. A failure is logged: a checkpoint that could not be deleted must not stop
    training."""
    api.get_manager().remove_tags(checkpoint_dir, [tag], strict=False)


_SAVE_KEYWORDS_SET_HERE = frozenset(
    {"checkpoint_dir", "tag", "model", "optimizer", "user_content", "num_workers", "use_xser", "async_save",
     "zero1_optimizer"}
)  # fmt: skip
_LOAD_KEYWORDS_SET_HERE = frozenset({"checkpoint_dir", "tag", "model", "optimizer", "allow_pickle"})


def _checked_keywords(
    cls: type[SaveOptions] | type[LoadOptions], given: Mapping[str, Any] | None, set_here: frozenset[str], what: str
) -> dict[str, Any]:
    """``given`` as keywords of ``cls``, checked when the CheckpointIO is built (not at the first save): names
    ``cls`` knows, not set by the CheckpointIO itself, with values ``cls`` accepts."""
    keywords = dict(given or {})
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown, taken = sorted(set(keywords) - fields), sorted(set(keywords) & set_here)
    if unknown or taken:
        problem = f"unknown option(s) {unknown}" if unknown else f"option(s) {taken} set by NxdCheckpointIO itself"
        raise TypeError(
            f"NxdCheckpointIO({what}=...): {problem}; it takes the keywords of nxd_ckpt.{cls.__name__} except "
            f"{sorted(set_here)} (use the constructor's own arguments for those)"
        )
    cls(".", "validating", **keywords)  # raises for a bad value
    return keywords
