"""Retention (``format/retention.py``): the ``KeepLatest`` policy as a pure value, and the one deletion of tags."""

from __future__ import annotations

import json
import os

import pytest

from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.retention import KeepLatest, apply_retention, delete_tags
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.storage import LocalStorage


def _make_tag(root, name, *, done=True, created_at=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "checkpoint").write_text("1")
    if created_at is not None:
        (d / "nxd_ckpt.json").write_text(json.dumps({"created_at": created_at}))
    if done:
        (d / "done").write_text("1")


def _info(name: str, t: float, complete: bool = True) -> tags.TagInfo:
    return tags.TagInfo(name=name, complete=complete, order_time=t, metadata=None)


# --------------------------------------------------------------------------------------------- the policy
def test_retention_policy_keeps_newest_n_and_drops_stale_incomplete():
    all_tags = [_info("s1", 1), _info("s2", 2), _info("x", 2.5, False), _info("s3", 3), _info("s4", 4)]
    all_tags.append(_info("n", 5, False))
    assert KeepLatest(2).to_delete(all_tags) == ["s1", "s2", "x"]
    assert KeepLatest(10).to_delete(all_tags) == []
    assert KeepLatest(2).to_delete(all_tags, protect={"s1"}) == ["s2", "x"]
    with pytest.raises(ValueError, match="num_kept_ckpts"):
        KeepLatest(0)


def test_keep_all_deletes_only_leftovers_older_than_every_complete_tag():
    """None and NxD's -1 (``g_iostate.submit_remove(None)``): every complete tag stays; interrupted saves older
    than all of them go, newer ones (perhaps being written) stay."""
    all_tags = [_info("old", 0.5, False), _info("s1", 1), _info("x", 1.5, False), _info("s2", 2)]
    assert KeepLatest(-1) == KeepLatest(None) and KeepLatest(None).keeps_all
    assert KeepLatest(None).to_delete(all_tags) == ["old"]
    assert KeepLatest(None).to_delete([_info("x", 1.0, False)]) == []  # no complete tag: nothing is surely stale


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_the_policy_refuses_what_num_kept_ckpts_refuses(bad):
    with pytest.raises(ValueError, match=r"num_kept_ckpts must be None or -1 \(keep all, as in NxD\)"):
        KeepLatest(bad)


def test_num_kept_ckpts_builds_the_policy_of_a_save(tmp_path):
    assert SaveOptions(str(tmp_path), "t", num_kept_ckpts=2).retention == KeepLatest(2)
    assert SaveOptions(str(tmp_path), "t").retention is None  # keep all: a save runs no retention
    assert SaveOptions(str(tmp_path), "t", num_kept_ckpts=-1).retention is None


def test_retention_keeps_an_interrupted_save_whose_whole_second_mtime_may_be_newer():
    """S3's LastModified is whole seconds: a leftover stamped 3.0 may have begun at 3.9, after the oldest kept tag
    (3.4); it is deleted only once its whole second ended before that tag began."""
    kept = [_info("s3", 3.4), _info("s4", 4.2)]

    def leftover(name: str, t: float) -> tags.TagInfo:
        return tags.TagInfo(name=name, complete=False, order_time=t, metadata=None, time_resolution_s=1.0)

    assert KeepLatest(2).to_delete([*kept, leftover("new", 3.0)]) == []
    assert KeepLatest(2).to_delete([*kept, leftover("old", 2.0)]) == ["old"]
    exact = tags.TagInfo(name="exact", complete=False, order_time=3.0, metadata=None)  # a local mtime: exact
    assert KeepLatest(2).to_delete([*kept, exact]) == ["exact"]


# --------------------------------------------------------------------------------------------- deleting
def test_delete_removes_done_first(tmp_path):
    _make_tag(tmp_path, "s1", created_at=1.0)
    s = LocalStorage(tmp_path)

    class CrashAfterDone(LocalStorage):
        def delete_tree(self, path):
            raise OSError("power loss")

    with pytest.raises(OSError):
        delete_tags(CrashAfterDone(tmp_path), ["s1"], strict=True)
    assert tags.list_tags(s) == []  # no longer looks complete
    assert [t.name for t in tags.list_tags(s, include_incomplete=True)] == ["s1"]
    assert delete_tags(CrashAfterDone(tmp_path), ["s1"]) == []  # not strict: logged, not raised


def test_deleting_a_linked_tag_unlinks_it_only(tmp_path):
    """Lightning's save_last="link" makes a tag a symbolic link to another: retention or a removal of the link
    must not delete the linked tag's 'done' (or anything else of it)."""
    _make_tag(tmp_path, "step_2", created_at=1.0)
    os.symlink("step_2", tmp_path / "last")
    s = LocalStorage(tmp_path)
    assert delete_tags(s, ["last"]) == ["last"]
    assert sorted(os.listdir(tmp_path)) == ["step_2"] and (tmp_path / "step_2" / "done").exists()
    _make_tag(tmp_path, "step_4", created_at=2.0)
    os.symlink("step_4", tmp_path / "last")  # as old as step_4; the name orders it before: retention deletes it
    assert sorted(apply_retention(s, KeepLatest(1))) == ["last", "step_2"]
    assert sorted(os.listdir(tmp_path)) == ["step_4"] and tags.latest_tag(s) == "step_4"


def test_only_tags_that_exist_are_deleted_and_reported(tmp_path):
    _make_tag(tmp_path, "s1", created_at=1.0)
    os.symlink("gone", tmp_path / "dangling")  # a link whose tag was deleted still counts
    assert delete_tags(LocalStorage(tmp_path), ["s1", "missing", "dangling"]) == ["s1", "dangling"]
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="invalid checkpoint tag"):
        delete_tags(LocalStorage(tmp_path), ["../etc"], strict=True)
    assert delete_tags(LocalStorage(tmp_path), ["../etc"]) == []


def test_retention_keeps_the_newest_and_the_protected_tag(tmp_path):
    storage = LocalStorage(str(tmp_path))
    for i, tag in enumerate(["a", "b", "c"]):
        storage.write_bytes(layout.tag_path(tag, layout.CHECKPOINT_MARKER), b"1")
        storage.write_bytes(layout.tag_path(tag, layout.DONE_MARKER), b"1")
        os.utime(tmp_path / tag / layout.DONE_MARKER, (1000 + i, 1000 + i))
    assert apply_retention(storage, KeepLatest(1), protect={"c"}) == ["a", "b"]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert apply_retention(storage, None, protect={"c"}) == []  # None keeps everything
    assert sorted(os.listdir(tmp_path)) == ["c"]
