"""The Lightning classes (``NxdCheckpointIO``, ``NxdDDPStrategy``, ``NxdXLAStrategy``, ``NxdXLAAccelerator``), built
on first use over the Lightning package in use: each is this package's Lightning-independent part in front of
Lightning's own class."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from nxd_ckpt.lightning.checkpoint_io import NxdCheckpointIOBase
from nxd_ckpt.lightning.package import PACKAGES, lightning_package
from nxd_ckpt.lightning.strategies import AnyXLADevice, SavesOnEveryRank, TorchrunXLA

PUBLIC = ("NxdCheckpointIO", "NxdDDPStrategy", "NxdXLAStrategy", "NxdXLAAccelerator")
"""The classes built here, as ``nxd_ckpt.lightning`` exports them."""

_IO_DOC = """A Lightning ``CheckpointIO`` that saves each checkpoint as an nxd_ckpt tag in NxD's layout: the tag of
``checkpoint_location(path)``, with ``state_dict`` as the model, ``optimizer_states[0]`` as the optimizer and the rest
as user content (NxDT's split). Every rank must save: use it with ``NxdDDPStrategy`` or ``NxdXLAStrategy``. Its
arguments are ``NxdCheckpointIOBase``'s; docs/lightning.md has the recipe."""

_DDP_DOC = """Lightning's ``DDPStrategy`` (same arguments) whose checkpoint saves and removals run the
``NxdCheckpointIO`` on every rank (Lightning's own calls it on global rank 0 only; an nxd_ckpt save is collective).
With another CheckpointIO it behaves as Lightning's ``DDPStrategy``."""

_built: dict[str, dict[str, type]] = {}


def _classes(pl: ModuleType) -> dict[str, type]:
    """The Lightning classes of this package, built once per Lightning package."""
    if pl.__name__ not in _built:
        _built[pl.__name__] = _build(pl)
    return _built[pl.__name__]


def _build(pl: ModuleType) -> dict[str, type]:
    """Each class: its Lightning-independent part in front of the Lightning class of ``pl``, named as
    ``nxd_ckpt.lightning`` exports it (so pickle finds it there)."""

    def make(name: str, bases: tuple[type, ...], doc: str | None, **attrs: Any) -> type:
        """A class ``name`` over ``bases``, documented by ``doc``."""
        return type(name, bases, {"__module__": __package__, "__qualname__": name, "__doc__": doc, **attrs})

    accelerator = make("NxdXLAAccelerator", (AnyXLADevice, pl.accelerators.XLAAccelerator), AnyXLADevice.__doc__)
    return {
        "NxdCheckpointIO": make("NxdCheckpointIO", (NxdCheckpointIOBase, pl.plugins.io.CheckpointIO), _IO_DOC),
        "NxdDDPStrategy": make("NxdDDPStrategy", (SavesOnEveryRank, pl.strategies.DDPStrategy), _DDP_DOC),
        "NxdXLAStrategy": make(
            "NxdXLAStrategy",
            (TorchrunXLA, pl.strategies.XLAStrategy),
            TorchrunXLA.__doc__,
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


def public_class(name: str) -> type:
    """The class ``name`` (one of ``PUBLIC``) built on the Lightning package in use (``lightning_package``)."""
    return _classes(lightning_package())[name]
