"""PyTorch Lightning integration: a ``CheckpointIO`` that writes nxd_ckpt (NxD-layout) tags, and strategies whose
checkpoint saves run on every rank (an nxd_ckpt save is collective; Lightning's stock strategies save on global
rank 0 only).

    from nxd_ckpt.lightning import NxdCheckpointIO, NxdDDPStrategy

    trainer = Trainer(strategy=NxdDDPStrategy(), plugins=[NxdCheckpointIO(async_save=True)],
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Lightning names a checkpoint by a file path; here that path is a tag directory (``checkpoint_location``):
``D/<name>[-vN].ckpt`` is the tag ``<name>.ckpt`` of the checkpoint directory ``D``, as in NxDT's
``NLPCheckpointIO``. The ``.ckpt`` stays in the tag so that Lightning still finds its files (``ckpt_path="last"``
looks for ``last*.ckpt`` entries in ``D``); the ``-vN`` version counter Lightning appends when the name already
exists is dropped, so that a name is saved again (a complete tag is replaced only once the new one is complete).
Lightning's checkpoint dict is split as NxDT splits it: ``state_dict`` is the model, ``optimizer_states[0]`` the
optimizer and everything else the user content.

Lightning is imported on first use of the classes, from whichever of ``pytorch_lightning`` (2.x) and
``lightning.pytorch`` is already imported, else the first of them that is installed (``lightning_package``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from nxd_ckpt import api, xla
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.describe import describe
from nxd_ckpt.options import LoadOptions, SaveOptions
from nxd_ckpt.ranks import coordinator
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.storage import Storage, storage_for

logger = logging.getLogger("nxd_ckpt")

PACKAGES = ("pytorch_lightning", "lightning.pytorch")
"""The Lightning packages this module works with, in order of preference when neither is imported yet."""

_VERSION_SUFFIX = re.compile(r"-v\d+(?=(\.[^.]*)?$)")
"""Lightning's version counter: ``-vN`` right before the file extension (or at the end of a name without one)."""


# ----------------------------------------------------------------------------------------------- Lightning
def lightning_package() -> ModuleType:
    """The Lightning package to build on: one already imported wins (so a program using ``lightning.pytorch``
    gets classes of that package), else the first installed of ``PACKAGES``; 2.x only."""
    names = [n for n in PACKAGES if n in sys.modules] or list(PACKAGES)
    errors = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        major = str(getattr(module, "__version__", "0")).split(".")[0]
        if not major.isdigit() or int(major) < 2:
            raise ImportError(
                f"nxd_ckpt.lightning needs Lightning 2.x; {name} is {getattr(module, '__version__', '?')}: "
                "pip install 'pytorch-lightning>=2.1,<3'"
            )
        return module
    raise ImportError(
        "nxd_ckpt.lightning needs PyTorch Lightning 2.x and neither pytorch_lightning nor lightning.pytorch could "
        f"be imported ({'; '.join(errors)}): pip install 'pytorch-lightning>=2.1,<3' (or the 'lightning' package)"
    )


# ----------------------------------------------------------------------------------------------- paths
def checkpoint_location(path: str | os.PathLike[str], strip_version: bool = True) -> tuple[str, str]:
    """Lightning's checkpoint path -> (checkpoint directory, tag).

    ``ckpts/epoch=0-step=4.ckpt`` -> ``("ckpts", "epoch=0-step=4.ckpt")``; ``ckpts/last-v1.ckpt`` ->
    ``("ckpts", "last.ckpt")`` with ``strip_version`` (NxDT's behaviour; NxDT cuts from the first ``-v`` anywhere in
    the path, which mangles names such as ``val-vloss=...``: only a ``-v<digits>`` counter is removed here).
    ``s3://bucket/run/last.ckpt`` -> ``("s3://bucket/run", "last.ckpt")``.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"a Lightning checkpoint path must be a str or os.PathLike of str, got {path!r}")
    text = text.rstrip("/")
    directory, name = os.path.split(text)
    if not name:
        raise ValueError(f"Lightning checkpoint path {path!r} has no file name: expected DIR/NAME.ckpt")
    if strip_version:
        name = _VERSION_SUFFIX.sub("", name)
    return directory or ".", name


# ----------------------------------------------------------------------------------------------- the dict
def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """Lightning's checkpoint dict -> (model state, optimizer state or None, user content), as NxDT splits it.

    ``optimizer_states`` holds one state per optimizer: exactly one goes to the optimizer; none (a module without
    optimizers) stays in the user content as ``[]``; absent (``save_weights_only``) means no optimizer; more than
    one is refused, as by NxDT (an nxd_ckpt tag holds one optimizer). ``checkpoint`` itself is not modified."""
    if "state_dict" not in checkpoint:
        raise KeyError("Lightning's checkpoint dict has no 'state_dict' (the model's weights); nothing to save")
    rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    optimizer = None
    states = rest.get("optimizer_states")
    if states is not None:
        if len(states) > 1:
            raise ValueError(
                f"the Lightning module has {len(states)} optimizers; an nxd_ckpt checkpoint holds one optimizer "
                "(as NxD's and NxDT's): use one optimizer with several parameter groups"
            )
        if len(states) == 1:
            optimizer = rest.pop("optimizer_states")[0]
    return checkpoint["state_dict"], optimizer, _plain_config(rest)


def _plain_config(content: dict[str, Any]) -> dict[str, Any]:
    """OmegaConf containers in the user content become plain dicts and lists (as NxDT does), so that they load
    without unpickling OmegaConf classes; nothing changes when OmegaConf is not in use."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None:
        return content
    from lightning_utilities.core.apply_func import apply_to_collection

    containers = (omegaconf.DictConfig, omegaconf.ListConfig)
    return apply_to_collection(content, containers, omegaconf.OmegaConf.to_container)


def zero1_from_config(content: Mapping[str, Any]) -> bool:
    """NxDT's switch for ZeRO-1 optimizer state: ``hyper_parameters["cfg"]["wrap_with_zero"]`` (False if absent)."""
    hparams = content.get("hyper_parameters")
    cfg = hparams.get("cfg") if isinstance(hparams, Mapping) else None
    return bool(cfg.get("wrap_with_zero", False)) if isinstance(cfg, Mapping) else False


# ----------------------------------------------------------------------------------------------- removal
def _remove_tag(storage: Storage, tag: str) -> None:
    """Delete one tag (``done`` first; a symbolic link is unlinked, never followed). Failures are logged: a
    checkpoint that could not be deleted must not stop training."""
    try:
        local = storage.local_path(tag)
        if os.path.lexists(local) if local is not None else storage.exists(tag):  # a dangling link counts
            tags.delete_tag(storage, tag)
    except Exception as e:
        logger.warning("could not remove checkpoint %s in %s: %s", tag, storage.url, e)


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
    """Delete ``tag`` of ``checkpoint_dir`` behind every save this process has submitted (global rank 0 deletes;
    the other ranks do nothing). A save in flight is committed before its tag can be deleted, and the next save
    waits for the deletion, so a tag is never deleted while it is written."""
    manager = api.get_manager()
    if manager.coordinator().rank != 0:
        return
    storage = storage_for(checkpoint_dir)
    manager.queue_deletion(lambda: _remove_tag(storage, tag), name=f"remove {tag}")


# ----------------------------------------------------------------------------------------------- the classes
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
        tag = _through_link(storage_for(directory), tag)
        model: dict[str, Any] = {}
        optimizer: dict[str, Any] | None = None
        if not self.weight_init_only and "optimizer" in describe(storage_for(directory), tag).saved_items:
            optimizer = {}
        options = LoadOptions(
            directory, tag, model=model, optimizer=optimizer, allow_pickle=self.allow_pickle, **self.load_options
        )
        content = api.get_manager().load(options)
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


_IO_DOC = """A Lightning ``CheckpointIO`` that saves each checkpoint as an nxd_ckpt tag in NxD's layout: the tag of
``checkpoint_location(path)``, with ``state_dict`` as the model, ``optimizer_states[0]`` as the optimizer and the rest
as user content (NxDT's split). Every rank must save: use it with ``NxdDDPStrategy`` or ``NxdXLAStrategy``. Its
arguments are ``NxdCheckpointIOBase``'s; docs/lightning.md has the recipe."""

_built: dict[str, dict[str, type]] = {}


def _classes(pl: ModuleType) -> dict[str, type]:
    """The Lightning classes of this module, built once per Lightning package."""
    if pl.__name__ not in _built:
        _built[pl.__name__] = _build(pl)
    return _built[pl.__name__]


def _build(pl: ModuleType) -> dict[str, type]:
    def make(name: str, bases: tuple[type, ...], doc: str | None, **attrs: Any) -> type:
        return type(name, bases, {"__module__": __name__, "__qualname__": name, "__doc__": doc, **attrs})

    accelerator = make("NxdXLAAccelerator", (_AnyXLADevice, pl.accelerators.XLAAccelerator), _AnyXLADevice.__doc__)
    return {
        "NxdCheckpointIO": make("NxdCheckpointIO", (NxdCheckpointIOBase, pl.plugins.io.CheckpointIO), _IO_DOC),
        "NxdDDPStrategy": make("NxdDDPStrategy", (_SavesOnEveryRank, pl.strategies.DDPStrategy), _DDP_DOC),
        "NxdXLAStrategy": make(
            "NxdXLAStrategy",
            (_TorchrunXLA, pl.strategies.XLAStrategy),
            _TorchrunXLA.__doc__,
            _lightning=pl,
            _accelerator_class=accelerator,
        ),
        "NxdXLAAccelerator": accelerator,
    }


def classes_for(package: str) -> dict[str, type]:
    """``NxdCheckpointIO``/``NxdDDPStrategy``/``NxdXLAStrategy`` built on the named package (one of ``PACKAGES``),
    for a program that has both installed and wants the one not picked by default."""
    if package not in PACKAGES:
        raise ValueError(f"package must be one of {PACKAGES}, got {package!r}")
    return _classes(importlib.import_module(package))


_PUBLIC = ("NxdCheckpointIO", "NxdDDPStrategy", "NxdXLAStrategy", "NxdXLAAccelerator")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return _classes(lightning_package())[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------- strategies
# Mixins without a Lightning base; ``_build`` puts each in front of Lightning's class of the package in use.
class _SavesOnEveryRank:
    """Strategy mixin: checkpoint saves and removals run the ``NxdCheckpointIO`` on every rank (Lightning's own
    strategies call it on global rank 0 only; an nxd_ckpt save is collective). With another CheckpointIO the
    strategy behaves as Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase):
            io.save_on_every_rank(checkpoint, filepath, storage_options)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step. After the first one (the optimizer state exists then), an async ``NxdCheckpointIO``
        reserves the host memory of its first save (``prepare_async_save``: faulted in beside training at low
        priority), so that the first save blocks no longer than later ones."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase) and io.async_save and not getattr(self, "_nxd_prepared", False):
            self._nxd_prepared = True
            optimizers = list(self.optimizers)  # type: ignore[attr-defined]
            api.prepare_async_save(
                model=self.lightning_module_state_dict(),  # type: ignore[attr-defined]
                optimizer=self.optimizer_state(optimizers[0]) if len(optimizers) == 1 else None,  # type: ignore[attr-defined]
            )
        return out

    def remove_checkpoint(self, filepath: Any) -> None:
        """Every rank tells its CheckpointIO (which keeps the same record of tags on every rank); rank 0 deletes."""
        io = self.checkpoint_io
        if isinstance(io, NxdCheckpointIOBase):
            io.remove_checkpoint(filepath)
        else:
            super().remove_checkpoint(filepath)


_DDP_DOC = """Lightning's ``DDPStrategy`` (same arguments) whose checkpoint saves and removals run the
``NxdCheckpointIO`` on every rank (Lightning's own calls it on global rank 0 only; an nxd_ckpt save is collective).
With another CheckpointIO it behaves as Lightning's ``DDPStrategy``."""


class _AnyXLADevice:
    """Accelerator mixin: Lightning's XLA accelerator, available wherever torch_xla is (Trainium, XLA on CPU), not
    only on TPUs, without asking a TPU metadata server; one device per process under torchrun."""

    @staticmethod
    def is_available() -> bool:
        return xla.available()

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> int:
        if devices == "auto":
            return 1
        count = len(devices) if isinstance(devices, (list, tuple)) else devices
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"devices must be a positive int (XLA devices of this process), got {devices!r}")
        return count

    @staticmethod
    def get_parallel_devices(devices: Any) -> list:
        import torch

        return [torch.device("xla", i) for i in range(_AnyXLADevice.parse_devices(devices))]


class _TorchrunXLA(_SavesOnEveryRank):
    """Strategy mixin over Lightning's ``XLAStrategy``: every-rank saves, and processes started by torchrun.

    Under torchrun (``TORCHELASTIC_RUN_ID`` set), as NxDT runs on Trainium, ranks come from torchrun's variables,
    nothing is spawned, and the default process group is used (initialised with the ``xla`` backend if nobody did).
    When that group is not an ``xla`` one (``gloo``: XLA on CPU) the strategy's barrier, broadcast and reduce
    exchange host copies through it, since torch_xla's collectives do not cross processes there; gradients are
    still reduced by torch_xla (``XLAPrecision``). Outside torchrun it is Lightning's ``XLAStrategy`` (xmp.spawn).
    """

    _lightning: ModuleType  # the Lightning package (set by ``_build``)
    _accelerator_class: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and kwargs.get("accelerator") is None:
            kwargs["accelerator"] = self._accelerator_class()
        super().__init__(*args, **kwargs)
        environments = importlib.import_module(f"{self._lightning.__name__}.plugins.environments")
        self._torchrun = bool(environments.TorchElasticEnvironment.detect())
        if self._torchrun:
            self.cluster_environment = environments.TorchElasticEnvironment()

    @property
    def checkpoint_io(self) -> Any:
        io = self._checkpoint_io
        return io if isinstance(io, NxdCheckpointIOBase) else super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if isinstance(io, NxdCheckpointIOBase):
            self._checkpoint_io = io
        else:  # Lightning's own check (an XLACheckpointIO)
            self._lightning.strategies.XLAStrategy.checkpoint_io.fset(self, io)

    def _configure_launcher(self) -> None:
        if self._torchrun:
            self._launcher = None  # torchrun started every process
        else:
            super()._configure_launcher()

    def set_world_ranks(self) -> None:
        if self._torchrun:
            self._lightning.strategies.DDPStrategy.set_world_ranks(self)
        else:
            super().set_world_ranks()

    def setup_distributed(self) -> None:
        if not self._torchrun:
            return super().setup_distributed()
        if not coordinator.is_distributed():
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" backend
            self._process_group_backend = "xla"
        return self._lightning.strategies.DDPStrategy.setup_distributed(self)

    def _host_collectives(self) -> bool:
        return self._torchrun and coordinator.backend() not in (None, "xla")

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if self._host_collectives():
            api.get_manager().coordinator().barrier(f"Lightning barrier {name or ''}".strip())
        else:
            super().barrier(name, *args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._host_collectives():
            return super().broadcast(obj, src)
        device = getattr(obj, "device", None)
        out = api.get_manager().coordinator().broadcast_object(obj.cpu() if device is not None else obj, src=src)
        return out.to(device) if device is not None else out

    def reduce(self, output: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not self._host_collectives():
            return super().reduce(output, group, reduce_op)
        return _host_reduce(self, output, reduce_op)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        xla.mark_step()  # as Lightning's XLA strategy: no rank enters the save with a graph pending
        super().save_checkpoint(checkpoint, filepath, storage_options)


def _host_reduce(strategy: Any, output: Any, reduce_op: Any) -> Any:
    """Sum (or mean) of ``output`` over the ranks through host copies (``NxdXLAStrategy`` under a gloo group)."""
    import torch

    op = str(getattr(reduce_op, "name", reduce_op) or "sum").lower()
    if op not in ("sum", "mean", "avg"):
        raise ValueError(f"NxdXLAStrategy reduces with sum, mean or avg only, got {reduce_op!r}")
    tensor = output if isinstance(output, torch.Tensor) else torch.tensor(output)
    values = api.get_manager().coordinator().all_gather_object(tensor.detach().cpu(), phase="Lightning reduce")
    total = torch.stack(values).sum(dim=0)
    if op in ("mean", "avg"):
        total = total / len(values)
    return total.to(strategy.root_device)


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
