"""A crash at every deletion of a retention pass never leaves a tag that looks complete but is not."""

from __future__ import annotations

import shutil

import pytest

import nxd_ckpt as nxd
from harness.crashloop import model_state, optimizer_state, run_retention
from nxd_ckpt.format import tags
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.device_independent


def _pristine(root) -> str:
    ckpt = str(root / "pristine")
    for step in range(1, 5):
        nxd.save_checkpoint(
            ckpt, f"step_{step}", model=model_state(step), optimizer=optimizer_state(step), user_content={"step": step}
        )
    return ckpt


def test_sigkill_at_every_deletion_of_retention(tmp_path):
    pristine = _pristine(tmp_path)
    full = str(tmp_path / "full")
    shutil.copytree(pristine, full)
    deletions = run_retention(full, keep=1)
    assert nxd.list_checkpoint_tags(full) == ["step_4"] and deletions > 10
    kill_points = 0
    for kill_after in range(deletions):
        ckpt = str(tmp_path / f"k{kill_after}")
        shutil.copytree(pristine, ckpt)
        assert run_retention(ckpt, keep=1, kill_after=kill_after) == -1
        kill_points += 1
        complete = nxd.list_checkpoint_tags(ckpt)
        assert complete[-1] == "step_4", complete
        for tag in complete:  # anything with 'done' is whole: every file present and intact
            report = nxd.verify(ckpt, tag)
            assert report.ok, report.summary()
        model: dict = {}
        assert nxd.load_checkpoint(ckpt, tag=complete[0], model=model) == {"step": int(complete[0][5:])}
        assert_state_equal(model, model_state(int(complete[0][5:])))
        # A later retention pass finishes the job the crash interrupted.
        run_retention(ckpt, keep=1)
        assert [t.name for t in tags.list_tags(LocalStorage(ckpt), include_incomplete=True)] == ["step_4"]
        shutil.rmtree(ckpt)
    print(f"\n[retention] {kill_points} kill points (one per unlink/rmdir of a 3-tag retention pass)")
