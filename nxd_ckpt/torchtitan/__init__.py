"""TorchTitan integration: ``CheckpointManager``, TorchTitan's checkpoint manager over ``nxd_ckpt.dcp``
(docs/torchtitan.md). Needs the ``torchtitan`` extra (``pip install "nxd-ckpt[torchtitan]"``: torchtitan 0.3.0,
Python >= 3.11); ``import nxd_ckpt`` never imports this package.
"""

from __future__ import annotations

try:
    import torchtitan.components.checkpointer  # noqa: F401  (checked first: the error below names the fix)
except ImportError as e:  # pragma: no cover - exercised where torchtitan is missing
    raise ImportError(
        f"nxd_ckpt.torchtitan needs TorchTitan 0.3.0 ({e}); install it with: pip install 'nxd-ckpt[torchtitan]' "
        "(Python >= 3.11)"
    ) from e

from nxd_ckpt.torchtitan.manager import CheckpointManager

__all__ = ["CheckpointManager"]
