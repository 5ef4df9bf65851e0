"""LocalStorage's O_DIRECT write path (storage/direct.py): exact bytes for files around the chunk size, written
in odd-sized pieces, on a disk and on tmpfs (where O_DIRECT may be refused and writes fall back)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from nxd_ckpt.storage import LocalStorage, direct

CHUNK = direct.CHUNK_BYTES
SMALL = direct.DIRECT_MIN_BYTES


@pytest.mark.parametrize(
    "size", [0, 5, SMALL - 1, SMALL, SMALL + 1, CHUNK - 1, CHUNK, CHUNK + SMALL + 3, 2 * CHUNK + 12345]
)
def test_bytes_round_trip_exactly(tmp_path, size):
    data = os.urandom(size)
    storage = LocalStorage(tmp_path)
    with storage.open_write("d/f.bin") as f:
        assert isinstance(f, direct.DirectWriter)
        for start in range(0, size, 7_000_001):  # pieces that straddle chunk boundaries
            f.write(memoryview(data)[start : start + 7_000_001])
        assert f.tell() == size
    assert storage.read_bytes("d/f.bin") == data
    assert os.path.getsize(tmp_path / "d" / "f.bin") == size  # a padded O_DIRECT tail was truncated back
    assert [n for n in os.listdir(tmp_path / "d")] == ["f.bin"]  # no temporary file left behind


@pytest.fixture
def direct_dir(tmp_path):
    """``tmp_path``, or a skip where its filesystem refuses O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    try:
        if not flag:
            raise OSError("no O_DIRECT flag on this platform")
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | flag))
    except OSError:
        pytest.skip("no O_DIRECT on this filesystem")
    os.unlink(tmp_path / "probe")
    return tmp_path


@pytest.mark.parametrize("size", [SMALL, SMALL + 4097, 3 * CHUNK // 2])
def test_tails_of_large_files_bypass_the_page_cache(direct_dir, monkeypatch, size):
    """Every byte of a file of at least DIRECT_MIN_BYTES goes out with O_DIRECT, the partial last block too."""
    buffered_writes: list[int] = []
    real_write = os.write

    def spying_write(fd, data):
        if not direct._is_direct(fd):
            buffered_writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", spying_write)
    data = os.urandom(size)
    LocalStorage(direct_dir).write_bytes("f.bin", data)
    assert buffered_writes == []
    assert (direct_dir / "f.bin").read_bytes() == data


def test_small_files_stay_buffered(tmp_path, monkeypatch):
    direct_writes: list[int] = []
    real_write = os.write

    def spying_write(fd, data):
        if direct._is_direct(fd):
            direct_writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", spying_write)
    LocalStorage(tmp_path).write_bytes("f.bin", b"x" * (SMALL - 1))
    assert direct_writes == [] and os.path.getsize(tmp_path / "f.bin") == SMALL - 1


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


def test_deferred_fsync_writes_every_file_and_nests(tmp_path):
    storage = LocalStorage(tmp_path)
    with storage.deferred_fsync():
        with storage.deferred_fsync():
            storage.write_bytes("a/1.bin", b"one")
        storage.write_bytes("a/2.bin", os.urandom(CHUNK + 9))
        assert storage._batch is not None and len(storage._batch) == 2
    assert storage._batch is None
    assert storage.read_bytes("a/1.bin") == b"one" and storage.size("a/2.bin") == CHUNK + 9
    with pytest.raises(RuntimeError), storage.deferred_fsync():
        storage.write_bytes("a/3.bin", b"x")
        raise RuntimeError("a failed save")
    assert storage._batch is None  # the next writes fsync one by one again


@pytest.mark.parametrize("lined_up", [True, False])
def test_large_writes_lined_up_with_the_file_skip_the_chunk_buffer(direct_dir, monkeypatch, lined_up):
    """A write whose memory address is congruent to the file position goes out from its own memory."""
    data = np.frombuffer(os.urandom(5 * direct.IN_PLACE_MIN_BYTES + 123), dtype=np.uint8)
    prefix = bytes(range(256)) * 3  # 768 bytes before it
    skip = (prefix_len := len(prefix)) - data.ctypes.data % direct.BLOCK_BYTES
    offset = skip % direct.BLOCK_BYTES if lined_up else (skip + 64) % direct.BLOCK_BYTES
    body = data[offset:]
    sources: list[int] = []
    real_write = os.write

    def spying_write(fd, view):
        sources.append(np.frombuffer(view, np.uint8).ctypes.data)
        return real_write(fd, view)

    monkeypatch.setattr(direct.os, "write", spying_write)
    storage = LocalStorage(direct_dir)
    with storage.open_write("f.bin") as f:
        f.write(prefix)
        f.write(memoryview(body))
    assert (direct_dir / "f.bin").read_bytes() == prefix + body.tobytes()
    from_tensor_memory = [a for a in sources if body.ctypes.data <= a < body.ctypes.data + body.nbytes]
    assert bool(from_tensor_memory) == lined_up
    assert prefix_len == 768


def test_a_full_chunk_goes_to_the_disk_while_the_writer_fills_the_next_one(direct_dir, monkeypatch):
    """The write of a full chunk runs on a helper thread: the writer copies the next bytes meanwhile (a synchronous
    O_DIRECT write would add the disk's time to the copy's and the hashing's); the bytes stay exact and in order."""
    import threading

    started, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real_write_all = direct._write_all

    def held_write_all(fd, view):
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30), "the test never released the chunk's write"
        real_write_all(fd, view)

    monkeypatch.setattr(direct, "_write_all", held_write_all)
    data = os.urandom(2 * CHUNK + 12345)
    storage = LocalStorage(direct_dir)
    with storage.open_write("f.bin") as f:
        f.write(memoryview(data)[:CHUNK])  # one full chunk: handed to a helper thread
        assert started.wait(30)
        f.write(memoryview(data)[CHUNK : 2 * CHUNK - 1])  # returns while the first chunk's write is held
        assert not release.is_set()
        release.set()
        f.write(memoryview(data)[2 * CHUNK - 1 :])
    assert storage.read_bytes("f.bin") == data
    assert threads[0].startswith("nxd_direct_write"), threads


def test_an_error_of_a_chunk_write_reaches_the_writer(direct_dir, monkeypatch):
    import errno

    from nxd_ckpt.errors import StorageError

    def full_disk(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct, "_write_all", full_disk)
    storage = LocalStorage(direct_dir)
    with pytest.raises(StorageError, match="No space left on device"), storage.open_write("f.bin") as f:
        f.write(os.urandom(CHUNK))  # the chunk fails on the helper thread
        f.write(b"x")  # the next call that waits for it, or the end of the file, raises
    assert os.listdir(direct_dir) == [], "a failed file left something behind"
