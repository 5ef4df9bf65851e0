"""NxD's checkpoint names where frameworks reach for them: ``install()`` routes them through nxd_ckpt.

NeuronX Distributed Training (Lightning's ``NLPCheckpointIO``) and optimum-neuron (``save_pretrained``) call
``neuronx_distributed.save_checkpoint`` / ``neuronx_distributed.trainer.save_checkpoint`` and reach into
``neuronx_distributed.trainer.checkpoint.g_iostate`` (``wait_save(async_remove=...)``,
``submit_remove(num_kept, async_remove, remove_tags)``). After

    import nxd_ckpt.compat
    nxd_ckpt.compat.install()   # once, before training starts

those names are nxd_ckpt's, so the frameworks run unchanged and write nxd_ckpt's checkpoints (NxD's layout). Where
NxD is installed its modules are patched in place; where it is not, ``install()`` provides
``neuronx_distributed``, ``neuronx_distributed.trainer`` and ``neuronx_distributed.trainer.checkpoint`` holding
only these names. ``uninstall()`` puts back what was there. Without ``install()`` the same objects are
``nxd_ckpt.compat.g_iostate`` (also ``nxd_ckpt.g_iostate``) and the functions of ``nxd_ckpt``.

As in NxD, ``neuronx_distributed.trainer.checkpoint.g_iostate`` is ``None`` until the first save through these
names (NxDT's ``remove_checkpoint`` relies on that to do nothing before it); ``nxd_ckpt.compat.g_iostate`` is
always the object.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from typing import Any

from nxd_ckpt import api
from nxd_ckpt.errors import CheckpointError

logger = logging.getLogger("nxd_ckpt")

CHECKPOINT_MODULE = "neuronx_distributed.trainer.checkpoint"
_PACKAGES = ("neuronx_distributed", "neuronx_distributed.trainer")
_NAMES = ("save_checkpoint", "load_checkpoint", "finalize_checkpoint", "has_checkpoint")


class IOState:
    """NxD's ``CheckpointIOState`` surface (``g_iostate``) over nxd_ckpt's process-wide manager.

    Deletions run on rank 0, on the manager's writer thread behind every save already queued, so a tag is
    never deleted while a save is still writing it or its predecessor; ``async_remove=False`` waits for them.
    """

    def __init__(self) -> None:
        self.checkpoint_dir: Any = None
        """The directory of the last save through these names (``submit_remove`` deletes from it)."""

    def wait_save(self, async_remove: bool = False) -> None:
        """Wait until every save in flight is durable and committed; raise a background failure.
        ``async_remove`` is accepted for NxD's signature (retention already runs behind each save)."""
        manager = api.get_manager()
        manager.check_for_errors()
        manager.wait_pending()
        manager.check_for_errors()

    def submit_remove(self, num_kept: int | None, async_remove: bool, remove_tags: list[str] | None = None) -> None:
        """Delete ``remove_tags`` (``done`` first), or, without them, the complete tags beyond the newest
        ``num_kept`` (None or -1 keeps all) and interrupted leftovers older than the oldest kept one."""
        if self.checkpoint_dir is None:
            raise CheckpointError(
                "g_iostate.submit_remove: no checkpoint was saved through nxd_ckpt.compat in this process, so "
                "there is no checkpoint directory to remove from; save first (or delete with nxd-ckpt prune)"
            )
        api.get_manager().remove_tags(
            self.checkpoint_dir, list(remove_tags) if remove_tags else None, num_kept, wait=not async_remove
        )

    def wait_remove(self) -> None:
        """Wait for queued deletions (and the saves before them); raise a background failure."""
        self.wait_save(async_remove=False)

    def wait_all(self) -> None:
        """NxD's exit hook: everything pending, finished."""
        api.finalize_checkpoint()

    def finalize_shutdown(self) -> None:
        """NxD's interpreter-shutdown flag; nxd_ckpt needs nothing here."""


g_iostate = IOState()


def save_checkpoint(checkpoint_dir_str: str | os.PathLike[str], tag: str, *args: Any, **kwargs: Any) -> Any:
    """``nxd_ckpt.save_checkpoint``, remembered by ``g_iostate`` for ``submit_remove``."""
    report = api.save_checkpoint(checkpoint_dir_str, tag, *args, **kwargs)
    g_iostate.checkpoint_dir = checkpoint_dir_str
    module = sys.modules.get(CHECKPOINT_MODULE)
    if module is not None and _installed.get(CHECKPOINT_MODULE) is not None:
        module.g_iostate = g_iostate  # NxD's global appears with the first save
    return report


def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
    """``nxd_ckpt.load_checkpoint`` (NxD's signature; empty-dict targets are filled in place)."""
    return api.load_checkpoint(*args, **kwargs)


def finalize_checkpoint() -> None:
    """``nxd_ckpt.finalize_checkpoint``."""
    api.finalize_checkpoint()


def has_checkpoint(checkpoint_dir_str: str | os.PathLike[str]) -> bool:
    """``nxd_ckpt.has_checkpoint``."""
    return api.has_checkpoint(checkpoint_dir_str)


_REPLACEMENTS = {
    "save_checkpoint": save_checkpoint,
    "load_checkpoint": load_checkpoint,
    "finalize_checkpoint": finalize_checkpoint,
    "has_checkpoint": has_checkpoint,
}
_installed: dict[str, dict[str, Any] | None] = {}
"""Per patched module: the attributes it had before (``_MISSING`` where absent); a provided module maps to {}."""
_provided: list[str] = []
_MISSING = object()


def _real_nxd_checkpoint() -> types.ModuleType | None:
    """NxD's checkpoint module if NxD is installed and importable (PyPI's placeholder package raises)."""
    if CHECKPOINT_MODULE in sys.modules:
        return sys.modules[CHECKPOINT_MODULE]
    try:
        if importlib.util.find_spec("neuronx_distributed") is None:
            return None
        return importlib.import_module(CHECKPOINT_MODULE)
    except Exception as e:  # NxD's import needs the Neuron SDK; without it, nxd_ckpt provides the names
        logger.info("neuronx_distributed is not importable (%s); nxd_ckpt.compat provides its checkpoint names", e)
        return None


def _provide_modules() -> types.ModuleType:
    """``neuronx_distributed[.trainer[.checkpoint]]`` as stand-ins holding nxd_ckpt's names only."""
    for name in (*_PACKAGES, CHECKPOINT_MODULE):
        if name in sys.modules:
            continue
        module = types.ModuleType(name, "stand-in provided by nxd_ckpt.compat.install() (NxD is not installed)")
        if name != CHECKPOINT_MODULE:
            module.__path__ = []  # a package, so the submodule import statement finds the child in sys.modules
        sys.modules[name] = module
        _provided.append(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    checkpoint = sys.modules[CHECKPOINT_MODULE]
    checkpoint.g_iostate = None
    checkpoint.CheckpointIOState = IOState
    return checkpoint


def _patch(module: types.ModuleType, values: dict[str, Any]) -> None:
    saved = _installed.setdefault(module.__name__, {})
    for key, value in values.items():
        if saved is not None and key not in saved:
            saved[key] = getattr(module, key, _MISSING)
        setattr(module, key, value)


def install() -> None:
    """Route NxD's checkpoint names (``save_checkpoint``, ``load_checkpoint``, ``finalize_checkpoint``,
    ``has_checkpoint`` and ``g_iostate``) through nxd_ckpt, in ``neuronx_distributed``,
    ``neuronx_distributed.trainer`` and ``neuronx_distributed.trainer.checkpoint``. Idempotent."""
    if CHECKPOINT_MODULE in _installed:
        return
    checkpoint = _real_nxd_checkpoint() or _provide_modules()
    _patch(checkpoint, {**_REPLACEMENTS, "g_iostate": g_iostate if g_iostate.checkpoint_dir else None})
    for name in _PACKAGES:
        if name in sys.modules:
            _patch(sys.modules[name], _REPLACEMENTS)


def uninstall() -> None:
    """Undo ``install()``: the patched names get their old values back and provided modules go away."""
    for name, saved in list(_installed.items()):
        module = sys.modules.get(name)
        if module is not None and saved:
            for key, value in saved.items():
                if value is _MISSING:
                    delattr(module, key)
                else:
                    setattr(module, key, value)
    _installed.clear()
    for name in reversed(_provided):
        sys.modules.pop(name, None)
    _provided.clear()


def is_installed() -> bool:
    """Whether ``install()`` is in force."""
    return CHECKPOINT_MODULE in _installed
