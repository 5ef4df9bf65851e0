"""The wheel ships the library and nothing else: ``nxd_ckpt`` (with ``py.typed``) and, of ``nxd_ckpt.testing``,
only the helpers offered to users (docs/api.md), which import with nxd_ckpt's own dependencies alone. The test
harness (``harness/``), the tests and the scripts stay in the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent  # packaging: runs once, in the CPU lane

REPO = Path(__file__).resolve().parents[2]
USER_TESTING_MODULES = {"__init__", "counting", "fakes", "threadworld"}
"""``nxd_ckpt.testing``'s modules: what users are offered for their own tests. Anything else goes in harness/."""
TEST_ONLY_IMPORTS = (
    "harness",
    "tests",
    "pytest",
    "moto",
    "mfusepy",
    "fuse",
    "boto3",
    "torch_xla",
    "torchdata",
    "safetensors",
    "megatron",
    "tenacity",
    "lightning",
    "pytorch_lightning",
    "omegaconf",
)
"""Top-level modules of the test extra and the repository's own test code: the shipped helpers need none."""
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".venv", ".*_cache", "bench_out"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds (offline, with the installed setuptools) from a copy of the repository: building in
    place would leave build/ and egg-info behind in the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run(
        [*command, "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"pip wheel failed (is setuptools installed?):\n{done.stdout}\n{done.stderr}"
    (built,) = (root / "dist").glob("nxd_ckpt-*.whl")
    return built


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_package_only(wheel):
    tops = {name.split("/")[0] for name in _names(wheel)}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"nxd_ckpt"}, f"outside nxd_ckpt/: {sorted(tops)}"
    assert "nxd_ckpt/py.typed" in _names(wheel)
    assert "nxd_ckpt/cli/__main__.py" in _names(wheel) and "nxd_ckpt/save/pipeline.py" in _names(wheel)


def test_the_wheel_holds_no_harness_module(wheel):
    """Of ``nxd_ckpt/testing/`` only the user helpers ship; a harness module added there is named here."""
    testing = {
        Path(name).stem for name in _names(wheel) if name.startswith("nxd_ckpt/testing/") and name.endswith(".py")
    }
    assert testing == USER_TESTING_MODULES, (
        f"nxd_ckpt/testing/ ships {sorted(testing - USER_TESTING_MODULES)}: test-only helpers belong in harness/ "
        "(not shipped); a helper offered to users is documented in docs/api.md and listed in USER_TESTING_MODULES"
    )


_IMPORT_WITHOUT_TEST_EXTRAS = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is test-only: the shipped helpers must not import it")
sys.meta_path.insert(0, Block())
from nxd_ckpt.testing import counting, fakes, threadworld
import nxd_ckpt
assert nxd_ckpt.__file__.startswith(sys.argv[2]), nxd_ckpt.__file__
world = threadworld.ThreadWorld(2, timeout_s=30.0, count=True)
try:
    assert world.run(lambda rank: world.coordinator(rank).all_gather_object(rank)) == [[0, 1], [0, 1]]
finally:
    world.close()
model, opt, sched = fakes.make_training(device="cpu")
fakes.train_steps(model, opt, sched, steps=1, seed=0)
fakes.assert_state_equal(model.state_dict(), model.state_dict())
print("ok")
"""


def test_the_shipped_helpers_import_without_test_dependencies(wheel, tmp_path):
    """The wheel's ``nxd_ckpt.testing`` runs a ThreadWorld and the tiny model with every test-only module blocked
    (the harness, moto, FUSE, pytest, ...), imported from the unpacked wheel rather than the checkout."""
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITHOUT_TEST_EXTRAS, ",".join(TEST_ONLY_IMPORTS), str(unpacked)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
