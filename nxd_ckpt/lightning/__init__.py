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

Modules: ``package`` (which Lightning package), ``mapping`` (Lightning's path -> tag, its dict's split),
``checkpoint_io`` (``NxdCheckpointIOBase``: save, load, remove), ``strategies`` (the strategy and accelerator
mixins) and ``factory`` (the classes above, built over Lightning's own).
"""

from __future__ import annotations

from typing import Any

from nxd_ckpt.lightning.checkpoint_io import NxdCheckpointIOBase, queue_removal
from nxd_ckpt.lightning.factory import PUBLIC, classes_for, public_class
from nxd_ckpt.lightning.mapping import checkpoint_location, split_checkpoint, zero1_from_config
from nxd_ckpt.lightning.package import PACKAGES, lightning_package

__all__ = [
    "PACKAGES",
    "NxdCheckpointIO",
    "NxdCheckpointIOBase",
    "NxdDDPStrategy",
    "NxdXLAAccelerator",
    "NxdXLAStrategy",
    "checkpoint_location",
    "classes_for",
    "lightning_package",
    "queue_removal",
    "split_checkpoint",
    "zero1_from_config",
]


def __getattr__(name: str) -> Any:
    """The Lightning classes, built on first use (importing this package imports no Lightning)."""
    if name in PUBLIC:
        return public_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
