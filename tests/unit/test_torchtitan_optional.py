"""TorchTitan is an optional extra: the core and ``nxd_ckpt.dcp`` import without it, and ``nxd_ckpt.torchtitan``
without it says how to install it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.device_independent

_HIDE_TORCHTITAN = """
import sys
class _NoTorchTitan:
    def find_spec(self, name, path=None, target=None):
        if name == "torchtitan" or name.startswith("torchtitan."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _NoTorchTitan())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HIDE_TORCHTITAN + code], capture_output=True, text=True, timeout=120)


def test_the_core_imports_without_torchtitan():
    done = _run("import nxd_ckpt, nxd_ckpt.dcp; assert 'torchtitan' not in sys.modules; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_torchtitan_package_names_the_extra_when_torchtitan_is_missing():
    done = _run("import nxd_ckpt.torchtitan")
    assert done.returncode != 0
    assert "pip install 'nxd-ckpt[torchtitan]'" in done.stderr, done.stderr
