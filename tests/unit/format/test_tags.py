"""Complete tags, their order, and latest."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from nxd_ckpt.errors import CheckpointNotFoundError
from nxd_ckpt.format import tags
from nxd_ckpt.storage import LocalStorage


def _make_tag(root, name, *, done=True, created_at=None, mtime=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "checkpoint").write_text("1")
    if created_at is not None:
        (d / "nxd_ckpt.json").write_text(json.dumps({"created_at": created_at}))
    if done:
        (d / "done").write_text("1")
    if mtime is not None:
        for f in d.iterdir():
            os.utime(f, (mtime, mtime))


def test_latest_follows_recorded_creation_time_not_file_times(tmp_path):
    _make_tag(tmp_path, "step_10", created_at=100.0)
    _make_tag(tmp_path, "step_9", created_at=200.0)  # newer despite the smaller number
    s = LocalStorage(tmp_path)
    assert tags.latest_tag(s) == "step_9"
    # Copying the directory (new mtimes everywhere) must not change the answer.
    time.sleep(0.01)
    shutil.copytree(tmp_path, tmp_path.parent / "copy")
    os.utime(tmp_path.parent / "copy" / "step_10" / "done")
    assert tags.latest_tag(LocalStorage(tmp_path.parent / "copy")) == "step_9"


def test_nxd_written_tags_are_ordered_by_done_mtime(tmp_path):
    _make_tag(tmp_path, "b", mtime=2000)
    _make_tag(tmp_path, "a", mtime=3000)
    _make_tag(tmp_path, "c", done=False, mtime=4000)
    s = LocalStorage(tmp_path)
    assert [t.name for t in tags.list_tags(s)] == ["b", "a"]
    assert [t.name for t in tags.list_tags(s, include_incomplete=True)] == ["b", "a", "c"]
    assert tags.latest_tag(s) == "a"


def test_directories_that_are_not_checkpoints_are_ignored(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert tags.list_tags(LocalStorage(tmp_path), include_incomplete=True) == []


def test_resolve_errors_name_what_exists(tmp_path):
    s = LocalStorage(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        tags.resolve_tag(s, None)
    _make_tag(tmp_path, "step_1", created_at=1.0)
    _make_tag(tmp_path, "step_2", created_at=2.0, done=False)
    with pytest.raises(CheckpointNotFoundError, match=r"'step_5' .* does not exist; complete tags: step_1"):
        tags.resolve_tag(s, "step_5")
    with pytest.raises(CheckpointNotFoundError, match="'step_2' .* is incomplete"):
        tags.resolve_tag(s, "step_2")
    assert tags.resolve_tag(s, None) == "step_1"


def _counted_latest(root):
    from nxd_ckpt.testing.counting import RequestCountingStorage

    storage = RequestCountingStorage(LocalStorage(root))
    return tags.latest_tag(storage), sum(storage.requests.values())


def test_latest_over_1000_tags_costs_a_few_requests_with_the_root_index(tmp_path):
    """1 LIST per 1,000 names, 1 GET of the index and the newest candidate's checks: not ~4 requests per tag."""
    for step in range(1000):
        _make_tag(tmp_path, f"step_{step}", created_at=1000.0 + step)
    latest, unindexed = _counted_latest(tmp_path)
    assert latest == "step_999" and unindexed > 3000  # without the index: every tag is read
    tags.record_committed(LocalStorage(tmp_path), "step_999", 1999.0)  # the first commit indexes every tag
    latest, requests = _counted_latest(tmp_path)
    assert latest == "step_999" and requests <= 8, requests


def test_a_stale_or_damaged_index_costs_requests_never_a_wrong_or_half_written_tag(tmp_path):
    s = LocalStorage(tmp_path)
    for step in range(5):
        _make_tag(tmp_path, f"step_{step}", created_at=100.0 + step)
    tags.record_committed(s, "step_4", 104.0)
    os.remove(tmp_path / "step_4" / "done")  # deleted since, or half-deleted: not complete any more
    assert tags.latest_tag(s) == "step_3"
    _make_tag(tmp_path, "step_5", created_at=105.0, done=False)  # in progress, unknown to the index
    assert tags.latest_tag(s) == "step_3"
    _make_tag(tmp_path, "nxd_tag")  # written by NxD itself (no metadata): ordered by the mtime of 'done'
    assert tags.latest_tag(s) == "nxd_tag"
    shutil.rmtree(tmp_path / "nxd_tag")
    shutil.rmtree(tmp_path / "step_3")  # re-created under the same name, newer than the index says
    _make_tag(tmp_path, "step_3", created_at=200.0)
    assert tags.latest_tag(s) == "step_3"
    (tmp_path / ".nxd-tags.json").write_text("{not json")
    assert tags.latest_tag(s) == "step_3"
    os.remove(tmp_path / ".nxd-tags.json")
    assert tags.latest_tag(s) == "step_3" == tags.list_tags(s)[-1].name


def test_record_committed_drops_deleted_tags_and_starts_from_the_complete_ones(tmp_path):
    s = LocalStorage(tmp_path)
    _make_tag(tmp_path, "a", created_at=1.0)
    _make_tag(tmp_path, "b", created_at=2.0)
    _make_tag(tmp_path, "c", created_at=3.0, done=False)
    tags.record_committed(s, "b", 2.0)
    assert tags.read_tag_index(s) == {"a": 1.0, "b": 2.0}
    shutil.rmtree(tmp_path / "a")
    _make_tag(tmp_path, "d", created_at=4.0)
    tags.record_committed(s, "d", 4.0)
    assert tags.read_tag_index(s) == {"b": 2.0, "d": 4.0}
