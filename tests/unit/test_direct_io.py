"""LocalStorage's O_DIRECT write path (storage/direct.py): exact bytes for files around the chunk size, written
in odd-sized pieces, on a disk and on tmpfs (where O_DIRECT may be refused and writes fall back)."""

from __future__ import annotations

import os

import pytest

from nxd_ckpt.storage import LocalStorage, direct

CHUNK = direct.CHUNK_BYTES


@pytest.mark.parametrize("size", [0, 5, CHUNK - 1, CHUNK, 2 * CHUNK + 12345])
def test_bytes_round_trip_exactly(tmp_path, size):
    data = os.urandom(size)
    storage = LocalStorage(tmp_path)
    with storage.open_write("d/f.bin") as f:
        assert isinstance(f, direct.DirectWriter)
        for start in range(0, size, 7_000_001):  # pieces that straddle chunk boundaries
            f.write(memoryview(data)[start : start + 7_000_001])
        assert f.tell() == size
    assert storage.read_bytes("d/f.bin") == data
    assert [n for n in os.listdir(tmp_path / "d")] == ["f.bin"]  # no temporary file left behind


def test_tmpfs_or_unsupported_filesystem_still_writes(tmp_path):
    root = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    storage = LocalStorage(os.path.join(root, f"nxd_direct_{os.getpid()}"))
    data = os.urandom(CHUNK + 3)
    try:
        storage.write_bytes("x.bin", data)
        assert storage.read_bytes("x.bin") == data
    finally:
        storage.delete("x.bin")
        os.rmdir(storage.root)


def test_failed_write_leaves_nothing(tmp_path):
    storage = LocalStorage(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), storage.open_write("f.bin") as f:
        f.write(os.urandom(CHUNK + 1))
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_switch_off(tmp_path, monkeypatch):
    monkeypatch.setenv("NXD_CKPT_DIRECT_IO", "0")
    with LocalStorage(tmp_path).open_write("f.bin") as f:
        assert not isinstance(f, direct.DirectWriter)
        f.write(b"abc")
    assert (tmp_path / "f.bin").read_bytes() == b"abc"
