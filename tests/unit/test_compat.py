"""nxd_ckpt.compat: NxD's checkpoint names (and its ``g_iostate``) routed through nxd_ckpt, here where NxD is not
installed (install() provides the modules); tests/thirdparty runs NxDT's and optimum-neuron's real code on it."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading

import pytest
import torch

import nxd_ckpt as nxd
from harness.gated_storage import GatedStorage
from nxd_ckpt import compat
from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("neuronx_distributed") is not None, reason="checks the stand-in modules: NxD absent"
)


@pytest.fixture
def installed():
    compat.install()
    yield importlib.import_module(compat.CHECKPOINT_MODULE)
    compat.uninstall()
    compat.g_iostate.checkpoint_dir = None


def test_install_provides_nxd_names_and_uninstall_removes_them(installed, tmp_path):
    import neuronx_distributed as nxd_pkg
    import neuronx_distributed.trainer as trainer

    assert installed.g_iostate is None  # as in NxD: None until the first save (NxDT's remove_checkpoint checks it)
    model = TinyMLP()
    trainer.save_checkpoint(str(tmp_path), "step_1", model=model, user_content={"step": 1}, use_xser=True)
    assert installed.g_iostate is nxd.g_iostate is compat.g_iostate
    assert nxd_pkg.has_checkpoint(str(tmp_path)) and installed.has_checkpoint(str(tmp_path))
    target: dict = {}
    assert nxd_pkg.load_checkpoint(str(tmp_path), "step_1", model=target) == {"step": 1}  # filled in place
    assert_state_equal(target, model.state_dict())
    assert nxd.verify(str(tmp_path), "step_1").ok
    nxd_pkg.finalize_checkpoint()
    compat.uninstall()
    provided = ("neuronx_distributed", "neuronx_distributed.trainer", compat.CHECKPOINT_MODULE)
    assert not any(name in sys.modules for name in provided)
    with pytest.raises(ImportError):
        importlib.import_module(compat.CHECKPOINT_MODULE)


def test_submit_remove_waits_behind_saves_in_flight(installed, tmp_path):
    """NxDT's remove_checkpoint (``submit_remove(-1, async_save, [tag])``) while async saves are still writing:
    the deletion runs after them, the tag being written is never cut short, and the others stay complete."""
    gate = threading.Event()
    storage = GatedStorage(str(tmp_path), gate)
    state = {"w": torch.arange(4096.0)}
    installed.save_checkpoint(storage, "step_1", model=state, async_save=True)
    gate.set()
    installed.g_iostate.wait_save(async_remove=True)
    gate.clear()
    installed.save_checkpoint(storage, "step_2", model=state, async_save=True)  # blocked at its model file
    installed.g_iostate.submit_remove(-1, True, ["step_1", "step_2"])
    assert os.path.exists(tmp_path / "step_1" / "done")  # queued behind step_2, not run yet
    gate.set()
    installed.g_iostate.wait_save(async_remove=True)
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json"]  # step_2 completed first, then both went, 'done' first
    installed.save_checkpoint(storage, "step_3", model=state, async_save=True)
    installed.finalize_checkpoint()
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["step_3"] and nxd.verify(str(tmp_path), "step_3").ok


def test_submit_remove_by_count_and_sync(installed, tmp_path):
    model = TinyMLP()
    for step in range(1, 5):
        installed.save_checkpoint(str(tmp_path), f"step_{step}", model=model)
    os.makedirs(tmp_path / "step_0")  # an interrupted leftover older than every complete tag
    (tmp_path / "step_0" / "checkpoint").write_text("1")
    os.utime(tmp_path / "step_0" / "checkpoint", (1, 1))
    installed.g_iostate.submit_remove(None, False)  # keep all complete: only the leftover goes
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "step_1", "step_2", "step_3", "step_4"]
    installed.g_iostate.submit_remove(2, False)
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["step_3", "step_4"]
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "step_3", "step_4"]


def test_submit_remove_deletes_through_the_managers_injected_storage(installed, tmp_path, monkeypatch):
    """The process-wide manager built with its own storage: NxD's ``submit_remove`` deletes through it."""
    from nxd_ckpt import api
    from nxd_ckpt.manager import CheckpointManager
    from nxd_ckpt.storage import LocalStorage
    from nxd_ckpt.testing.counting import RequestCountingStorage

    storage = RequestCountingStorage(LocalStorage(str(tmp_path)))
    monkeypatch.setattr(api._default, "manager", CheckpointManager(storage=lambda _directory: storage))
    model = TinyMLP()
    for step in (1, 2):
        installed.save_checkpoint(str(tmp_path), f"step_{step}", model=model)
    deletes = storage.by_prefix["step_1"].get("DELETE", 0)  # the save's own (stale files it replaces)
    installed.g_iostate.submit_remove(-1, False, ["step_1"])
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["step_2"] and sorted(os.listdir(tmp_path)) == [
        ".nxd-tags.json",
        "step_2",
    ]
    assert storage.by_prefix["step_1"]["DELETE"] == deletes + 1  # 'done', through the injected storage (then the rest)


def test_submit_remove_before_any_save_says_what_to_do(installed):
    with pytest.raises(nxd.CheckpointError, match="save first"):
        compat.g_iostate.submit_remove(-1, False, ["step_1"])
    compat.g_iostate.checkpoint_dir = "/nonexistent"
    with pytest.raises(nxd.InvalidTagError):
        compat.g_iostate.submit_remove(-1, False, ["../etc"])
