"""Which Lightning package the classes are built on: ``pytorch_lightning`` (2.x) or ``lightning.pytorch``."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

PACKAGES = ("pytorch_lightning", "lightning.pytorch")
"""The Lightning packages this module works with, in order of preference when neither is imported yet."""


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
