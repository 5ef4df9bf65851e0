"""Deprecated alias of ``nxd_ckpt.inspection``: the old name shadowed the standard library's ``inspect``. Importing
it warns (DeprecationWarning) and gives the same objects; import ``nxd_ckpt.inspection`` (or use
``nxd_ckpt.open_checkpoint``) instead."""

from __future__ import annotations

import warnings
from typing import Any

from nxd_ckpt import inspection
from nxd_ckpt.inspection import *  # noqa: F403  (the public names, for ``from nxd_ckpt.inspect import Checkpoint``)
from nxd_ckpt.inspection import __all__  # noqa: F401

warnings.warn(
    "nxd_ckpt.inspect is deprecated (it shadowed the standard library's inspect): import nxd_ckpt.inspection, or "
    "use nxd_ckpt.open_checkpoint",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """Every other name of ``nxd_ckpt.inspection`` (``object_prefix``...), as the old module had it."""
    return getattr(inspection, name)
