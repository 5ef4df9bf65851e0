"""A DCP save killed between the two renames of its swap, as on Lustre and NFS (no ``RENAME_EXCHANGE``): the folder
is missing, its new copy and its old one sit under hidden names. The next load, through nxd_ckpt's reader or its
TorchTitan manager, gives the folder back its newest complete checkpoint first; TorchTitan's own manager, run before
any repair, takes no hidden copy for a step (its ``re.search`` scan) and resumes the newest step folder there, and,
after the repair, the repaired step. Retention deletes hidden copies older than the oldest step it keeps.

Each save runs in a forked process whose ``renameat2(RENAME_EXCHANGE)`` fails with EINVAL, SIGKILLed at the rename
that gives the staged copy the folder's name (``harness.dcp_crash``).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness.dcp_crash import (
    dcp_state,
    empty_state,
    kill_dcp_save_between_renames,
    kill_titan_save_between_renames,
    loaded_version,
)
from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.format.layout import DCP_COMMIT, HF_COMMIT

pytestmark = [
    pytest.mark.device_independent,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

TITAN_STEP = re.compile(r"step-(\d+)")
"""TorchTitan 0.3.0's scan of a checkpoint folder (``_find_load_step``, ``_purge_stale_checkpoints``)."""


def _save(path: str, version: int) -> None:
    dcp.save(dcp_state(version), storage_writer=StorageWriter(path), no_dist=True)


def _hidden(root: Any) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def test_the_hidden_copies_never_look_like_a_step_to_torchtitan():
    for folder in ("step-7", "ckpt-step-120", "step-3-final"):
        for name in (DCP_COMMIT.staging_dir(folder), DCP_COMMIT.replaced_dir(folder)):
            assert TITAN_STEP.search(name) is None, name
            assert DCP_COMMIT.folder_of(name) == folder  # and the name still says whose copy it is
    assert DCP_COMMIT.folder_of(".nxd-dcp-staging.step-7") == "step-7"  # an earlier version's name
    assert DCP_COMMIT.folder_of("step-7") is None and DCP_COMMIT.folder_of(".nxd-dcp-staging.a/b") is None


@pytest.mark.parametrize("resave", [True, False], ids=["resave", "new_folder"])
def test_the_reader_finishes_a_swap_killed_between_its_renames(tmp_path, resave):
    path = str(tmp_path / "step-2")
    _save(str(tmp_path / "step-1"), 1)
    if resave:
        _save(path, 2)
    kill_dcp_save_between_renames(path, 3)
    assert not os.path.exists(path)
    hidden = [DCP_COMMIT.staging_dir("step-2")] + ([DCP_COMMIT.replaced_dir("step-2")] if resave else [])
    assert _hidden(tmp_path) == sorted(hidden)  # killed between the renames: both copies hidden
    assert loaded_version(path) is None  # stock DCP: the folder is not there
    out = empty_state()
    dcp.load(out, storage_reader=StorageReader(path), no_dist=True)  # the swap is finished first
    assert out["step"] == 3 and all(torch.equal(v, dcp_state(3)["model"][k]) for k, v in out["model"].items())
    assert _hidden(tmp_path) == []  # the old copy is gone, the new one has the name
    assert loaded_version(path) == 3 and loaded_version(str(tmp_path / "step-1")) == 1


def test_the_reader_restores_the_old_copy_when_the_new_one_is_gone(tmp_path):
    path = str(tmp_path / "step-2")
    _save(path, 2)
    kill_dcp_save_between_renames(path, 3)
    shutil.rmtree(tmp_path / DCP_COMMIT.staging_dir("step-2"))  # e.g. deleted by hand
    assert loaded_version(path, verified=True) == 2
    assert _hidden(tmp_path) == []


def test_a_folder_with_no_copy_anywhere_is_still_not_found(tmp_path):
    os.makedirs(tmp_path / DCP_COMMIT.staging_dir("step-5"))  # a killed new save, unfinished: left alone
    with pytest.raises(Exception, match="holds no DCP checkpoint"):
        StorageReader(str(tmp_path / "step-5")).read_metadata()
    assert _hidden(tmp_path) == [DCP_COMMIT.staging_dir("step-5")]


def _titan_job(config: Any, base: str, seed: int) -> Any:
    from harness import titan_job

    return titan_job.TitanJob(config, seed, base)


def test_torchtitan_resumes_the_newest_complete_step_after_a_kill_between_the_renames(tmp_path):
    """Steps 1 and 2 saved; a restarted job re-saves step 2 and is killed between the renames. TorchTitan's own
    manager, first, resumes step 1 (no hidden copy counts); nxd_ckpt's manager finishes the swap and resumes the new
    step 2; TorchTitan's then resumes it too."""
    pytest.importorskip("torchtitan.components.checkpointer", reason="needs the torchtitan extra")
    from torchtitan.components.checkpointer import CheckpointManager as TitanManager

    from harness import titan_job
    from nxd_ckpt.torchtitan import CheckpointManager

    base, other = str(tmp_path / "job"), str(tmp_path / "reference")
    ours = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0)
    theirs = TitanManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0, last_save_model_only=False)
    with titan_job.gloo_world_of_one():
        first = _titan_job(ours, base, seed=0)
        first.train(1)
        at_step_1 = first.state()
        first.train(1)
        first.checkpointer.close()
        redo = _titan_job(ours, other, seed=5)  # what the killed job saved as step 2, saved elsewhere
        redo.train_state.step = 1
        redo.train(1)
        redo.checkpointer.close()
        new_step_2 = redo.state()
    kill_titan_save_between_renames(base, 2, 5)
    folder = os.path.join(base, "ckpt")
    with titan_job.gloo_world_of_one():
        stock = _titan_job(theirs, base, seed=9)
        assert stock.checkpointer.load() is True  # its scan takes no hidden copy for step 2
        titan_job.assert_same_state(at_step_1, stock.state())
        stock.checkpointer.close()
        assert sorted(os.listdir(folder)) == sorted(
            ["step-1", DCP_COMMIT.staging_dir("step-2"), DCP_COMMIT.replaced_dir("step-2")]
        )
        resumed = _titan_job(ours, base, seed=9)
        assert resumed.checkpointer.load() is True
        titan_job.assert_same_state(new_step_2, resumed.state())
        resumed.checkpointer.close()
        assert sorted(os.listdir(folder)) == ["step-1", "step-2"]
        stock = _titan_job(theirs, base, seed=9)
        assert stock.checkpointer.load() is True
        titan_job.assert_same_state(new_step_2, stock.state())
        stock.checkpointer.close()


def test_retention_deletes_hidden_copies_older_than_the_oldest_kept_step(tmp_path):
    """keep_latest_k also deletes what killed saves left hidden (a killed new save's staging, an old copy under
    an earlier version's name) once older than the oldest step kept; a newer hidden copy (a save that may be
    running) stays."""
    pytest.importorskip("torchtitan.components.checkpointer", reason="needs the torchtitan extra")
    from harness import titan_job
    from harness.dcp_crash import run_dcp_save
    from nxd_ckpt.torchtitan import CheckpointManager

    base = str(tmp_path / "job")
    folder = os.path.join(base, "ckpt")
    assert run_dcp_save(os.path.join(folder, "step-3"), 3, "nxd_ckpt", kill_after=8) == -1  # killed mid-write
    legacy = os.path.join(folder, ".nxd-dcp-replaced.step-1")  # what an earlier version named an old copy
    shutil.copytree(_saved_copy(tmp_path), legacy)
    newer = os.path.join(folder, DCP_COMMIT.staging_dir("step-9"))
    os.makedirs(newer)
    hf_staging = HF_COMMIT.staging_dir("step-2")  # a killed Hugging Face last step's staging
    os.makedirs(os.path.join(folder, hf_staging, "half-written"))
    assert _hidden(folder) == sorted(
        [DCP_COMMIT.staging_dir("step-3"), ".nxd-dcp-replaced.step-1", _name(newer), hf_staging]
    )
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=2)
    with titan_job.gloo_world_of_one():
        job = _titan_job(config, base, seed=0)
        job.train(6)
        job.checkpointer.close()
    assert sorted(os.listdir(folder)) == sorted(["step-4", "step-6", _name(newer)])


def _saved_copy(tmp_path: Any) -> str:
    path = str(tmp_path / "copy" / "step-1")
    _save(path, 1)
    return path


def _name(path: str) -> str:
    return os.path.basename(path)


def _load_on_every_rank(path: str, version: int) -> None:
    """Every rank loads ``path`` through nxd_ckpt's reader, each one finding the folder missing at first."""
    import warnings

    warnings.simplefilter("ignore")
    out = empty_state()
    dcp.load(out, storage_reader=StorageReader(path))
    expected = dcp_state(version)
    assert out["step"] == version
    assert all(torch.equal(out["model"][k], v) for k, v in expected["model"].items())


def test_every_rank_repairs_at_once_and_all_load_the_new_copy(tmp_path):
    from harness.multiprocess import run_on_ranks

    path = str(tmp_path / "step-2")
    _save(path, 2)
    kill_dcp_save_between_renames(path, 3)
    run_on_ranks(_load_on_every_rank, 4, dict(path=path, version=3))
    assert _hidden(tmp_path) == [] and loaded_version(path) == 3


def test_recovery_and_repair_handle_the_names_an_earlier_version_wrote(tmp_path):
    """An old copy left hidden as ``.nxd-dcp-replaced.step-2`` (before the names hid their dashes) goes back."""
    from nxd_ckpt.dcp import recover_folder

    for repair in ("reader", "recover_folder"):
        root = tmp_path / repair
        _save(str(root / "step-2"), 2)
        os.rename(root / "step-2", root / ".nxd-dcp-replaced.step-2")
        if repair == "reader":
            assert loaded_version(str(root / "step-2"), verified=True) == 2
        else:
            recover_folder(str(root / "step-2"))
            assert loaded_version(str(root / "step-2")) == 2
        assert _hidden(root) == []
