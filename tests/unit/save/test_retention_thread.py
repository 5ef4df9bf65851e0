"""Retention never runs on the training thread: a synchronous save hands its deletions to the writer thread,
after the new tag is complete; listings and the next save/load see them applied."""

from __future__ import annotations

import os
import threading

import nxd_ckpt as nxd
from nxd_ckpt.format import retention
from nxd_ckpt.save import writer
from nxd_ckpt.testing.fakes import TinyMLP


def test_sync_save_deletes_old_tags_on_the_writer_thread_after_the_new_tag_is_complete(tmp_path, monkeypatch):
    deletions: list[tuple[str, str, bool]] = []
    real_delete = retention.delete_tags
    release = threading.Event()

    def spying_delete(storage, names, **keywords):
        newest = sorted(os.listdir(tmp_path))[-1]
        for name in names:
            deletions.append((name, threading.current_thread().name, os.path.exists(tmp_path / newest / "done")))
        release.wait(timeout=60)  # a slow deletion (e.g. thousands of S3 objects) must not hold up the save
        return real_delete(storage, names, **keywords)

    monkeypatch.setattr(retention, "delete_tags", spying_delete)
    model = TinyMLP()
    release.set()
    for step in range(1, 4):
        nxd.save_checkpoint(tmp_path, f"step_{step}", model=model, num_kept_ckpts=2)
    assert nxd.list_checkpoint_tags(tmp_path) == ["step_2", "step_3"]  # step_1's deletion is done, not pending
    release.clear()
    report = nxd.save_checkpoint(tmp_path, "step_4", model=model, num_kept_ckpts=2)  # returns, deletion blocked
    assert report.completed and os.path.exists(tmp_path / "step_4" / "done")
    assert os.path.exists(tmp_path / "step_2")  # not deleted yet: the deletion waits on the writer thread
    release.set()
    assert nxd.list_checkpoint_tags(tmp_path) == ["step_3", "step_4"]  # listing waits for queued deletions
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "step_3", "step_4"]
    assert [d[0] for d in deletions] == ["step_1", "step_2"]
    assert {d[1] for d in deletions} == {writer.THREAD_NAME}
    assert all(complete for _, _, complete in deletions)  # the newest tag had 'done' before any deletion
