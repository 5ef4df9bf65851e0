"""Modules imported on first use, so commands that never touch a tensor (``nxd-ckpt list``, ``--help``) start
without paying for ``import torch`` (2-3 s)."""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """Stands in for the module ``name``; the first attribute access imports it (later ones find it loaded)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__dict__["_lazy_target"]), attr)


def lazy_module(name: str) -> Any:
    """``name`` itself when it is already imported, else a LazyModule for it."""
    module = importlib.sys.modules.get(name)  # type: ignore[attr-defined]
    return module if module is not None else LazyModule(name)
