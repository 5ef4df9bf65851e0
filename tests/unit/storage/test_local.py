"""LocalStorage: atomic writes, listing, deletion, and no path ever leaving the checkpoint directory."""

from __future__ import annotations

import os

import pytest

from nxd_ckpt.errors import InvalidTagError, StorageError
from nxd_ckpt.storage import LocalStorage, storage_for


def test_write_read_list_delete(tmp_path):
    s = LocalStorage(tmp_path)
    s.write_bytes("t/a/b.bin", b"hello world")
    assert s.read_bytes("t/a/b.bin") == b"hello world"
    assert s.read_bytes("t/a/b.bin", offset=6, length=3) == b"wor"
    assert s.list_dir("t") == ["a"]
    assert s.walk_files("") == ["t/a/b.bin"]
    assert s.size("t/a/b.bin") == 11 and s.exists("t/a")
    s.delete_tree("t")
    assert not s.exists("t") and s.list_dir("") == []


def test_failed_write_leaves_nothing_behind(tmp_path):
    s = LocalStorage(tmp_path)
    s.write_bytes("f", b"old")
    with pytest.raises(RuntimeError), s.open_write("f") as f:
        f.write(b"new partial")
        raise RuntimeError("crash mid-write")
    assert s.read_bytes("f") == b"old"
    assert os.listdir(tmp_path) == ["f"]  # no temporary file left


@pytest.mark.parametrize("bad", ["../escape", "/etc/passwd", "a/../../b", "a//b"])
def test_paths_cannot_leave_the_root(tmp_path, bad):
    s = LocalStorage(tmp_path / "ckpt")
    with pytest.raises((InvalidTagError, StorageError)):
        s.write_bytes(bad, b"x")
    with pytest.raises((InvalidTagError, StorageError)):
        s.delete_tree(bad)
    assert not (tmp_path / "escape").exists()


def test_refuses_to_delete_the_root(tmp_path):
    with pytest.raises(StorageError, match="refusing"):
        LocalStorage(tmp_path).delete_tree("")


def test_reading_a_missing_file_names_it(tmp_path):
    with pytest.raises(StorageError, match="nope.pt"):
        LocalStorage(tmp_path).read_bytes("nope.pt")


def test_storage_for_rejects_unknown_schemes(tmp_path):
    assert isinstance(storage_for(tmp_path), LocalStorage)
    with pytest.raises(ValueError, match="gs://b"):
        storage_for("gs://b/x")
