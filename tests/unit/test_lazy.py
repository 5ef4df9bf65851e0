"""A lazy module costs nothing until used: the import happens at the first attribute access, once."""

from __future__ import annotations

import sys
import types

from nxd_ckpt.lazy import LazyModule, lazy_module


def test_a_loaded_module_is_handed_back_as_it_is():
    assert lazy_module("json") is __import__("json")


def test_the_import_waits_for_the_first_attribute(monkeypatch):
    name = "nxd_ckpt_lazy_probe"
    imported = []

    class Finder:
        """Serves ``name`` and notes when Python imports it."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname != name:
                return None
            from importlib.machinery import ModuleSpec

            return ModuleSpec(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            imported.append(module.__name__)
            module.answer = 42

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = lazy_module(name)
    assert isinstance(module, LazyModule) and imported == []
    assert module.answer == 42 and module.answer == 42
    assert imported == [name]  # imported at the first access only
