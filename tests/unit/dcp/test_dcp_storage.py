"""nxd_ckpt.dcp.StorageWriter / StorageReader in one process (``no_dist``): stock DCP files both ways, manifests,
damage named on load, the staging folder and its commit, and what is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from nxd_ckpt.dcp import StorageReader, StorageWriter, recover_folder
from nxd_ckpt.errors import CheckpointError, InvalidTagError
from nxd_ckpt.format import layout
from nxd_ckpt.storage import DelegatingStorage, LocalStorage

pytestmark = pytest.mark.device_independent  # file protocol over CPU tensors: runs once, in the CPU lane


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        yield


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, 6, generator=g)
    return {
        "w": torch.randn(16, 4, generator=g),
        "view": base[:, 1:4],  # a non-contiguous view of a larger storage
        "ints": torch.arange(10, dtype=torch.int64) * seed,
        "nested": {"half": torch.randn(3, 3, generator=g).half(), "step": seed, "name": f"run-{seed}"},
    }


def _empty() -> dict:
    return {
        "w": torch.zeros(16, 4),
        "view": torch.zeros(8, 3),
        "ints": torch.zeros(10, dtype=torch.int64),
        "nested": {"half": torch.zeros(3, 3).half(), "step": -1, "name": ""},
    }


def _assert_same(got: dict, want: dict) -> None:
    for key in ("w", "view", "ints"):
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got["nested"]["half"], want["nested"]["half"])
    assert got["nested"]["step"] == want["nested"]["step"] and got["nested"]["name"] == want["nested"]["name"]


def _load(path: str, reader: str = "ours") -> dict:
    out = _empty()
    dcp.load(out, storage_reader=StorageReader(path) if reader == "ours" else dcp.FileSystemReader(path), no_dist=True)
    return out


def _save(path: str, state: dict, **kwargs) -> None:
    dcp.save(state, storage_writer=StorageWriter(path, **kwargs), no_dist=True)


def _message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize("threads", [1, 3])
def test_stock_dcp_reads_what_the_writer_wrote(tmp_path, threads):
    path = str(tmp_path / "step-1")
    _save(path, _state(1), thread_count=threads)
    _assert_same(_load(path, reader="stock"), _state(1))
    _assert_same(_load(path), _state(1))
    distcp = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert distcp == [f"__0_{i}.distcp" for i in range(threads)]


def test_every_file_is_in_the_rank_manifest_and_nothing_is_left_beside_the_folder(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, _state(1), thread_count=2)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # the staging folder became the checkpoint
    manifest = json.loads((tmp_path / "step-1" / "nxd_ckpt" / "manifest_rank_00000.json").read_text())
    files = {n for n in os.listdir(path) if not os.path.isdir(os.path.join(path, n))}
    assert set(manifest["files"]) == files == {"__0_0.distcp", "__0_1.distcp", ".metadata"}
    for name, (size, *_) in manifest["files"].items():
        assert os.path.getsize(os.path.join(path, name)) == size


def test_our_reader_reads_a_checkpoint_dcp_wrote(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save(_state(2), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    _assert_same(_load(path), _state(2))


def test_a_truncated_file_of_a_stock_checkpoint_is_named(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save(_state(2), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    file = os.path.join(path, "__0_0.distcp")
    os.truncate(file, os.path.getsize(file) - 100)
    with pytest.raises(CheckpointException) as excinfo:
        _load(path)
    assert "__0_0.distcp is truncated" in _message(excinfo)


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_distcp_is_detected_and_named(tmp_path, damage):
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    file = os.path.join(path, "__0_0.distcp")
    if damage == "truncated":
        os.truncate(file, os.path.getsize(file) - 1)
    else:
        with open(file, "r+b") as f:  # one byte inside the last tensor's data: torch.load would not notice
            f.seek(os.path.getsize(file) - 900)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointException) as excinfo:
        _load(path)
    assert f"{path}/__0_0.distcp is corrupt" in _message(excinfo)
    assert ("bytes but" if damage == "truncated" else "checksum") in _message(excinfo)


def test_a_damaged_metadata_is_named(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    meta = os.path.join(path, ".metadata")
    with open(meta, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(bytes(data))
    with pytest.raises(CheckpointException) as excinfo:
        _load(path)
    assert ".metadata" in _message(excinfo) and ("corrupt" in _message(excinfo) or "damaged" in _message(excinfo))


def test_a_failed_resave_keeps_the_old_checkpoint_and_the_next_save_cleans_up(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    broken = _state(2)
    broken["w"] = _Unsaveable(broken["w"])
    with pytest.raises((CheckpointException, Exception)):
        _save(path, broken)
    assert layout.DCP_COMMIT.staging_dir("step-1") in os.listdir(tmp_path)  # the failed save's files, beside it
    _assert_same(_load(path, reader="stock"), _state(1))
    _save(path, _state(3))
    _assert_same(_load(path), _state(3))
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


class _Unsaveable(torch.Tensor):
    """A tensor whose bytes cannot be produced: the save fails while writing."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> _Unsaveable:
        return torch.Tensor._make_subclass(cls, data)

    def detach(self) -> torch.Tensor:
        raise OSError("disk full (simulated)")


def test_a_save_beside_an_interrupted_two_rename_swap_restores_the_old_copy(tmp_path):
    """Where directories cannot be exchanged the swap is two renames; killed between them, the folder is missing
    and its old copy is hidden: recovery (the next save, or recover_folder) gives it its name back."""
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    os.rename(path, tmp_path / layout.DCP_COMMIT.replaced_dir("step-1"))
    os.makedirs(tmp_path / layout.DCP_COMMIT.staging_dir("step-1"))
    recover_folder(path)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    _assert_same(_load(path, reader="stock"), _state(1))


def test_without_directory_exchange_the_swap_is_two_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalStorage, "exchange_dirs", lambda self, a, b: False)
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    _save(path, _state(2))
    _assert_same(_load(path, reader="stock"), _state(2))
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


def test_storage_that_cannot_rename_writes_in_place_and_refuses_to_overwrite(tmp_path, monkeypatch):
    """Object stores (no directory rename): the folder is written in place, ``.metadata`` last; a folder holding a
    complete checkpoint is refused rather than overwritten."""
    monkeypatch.setattr(LocalStorage, "renames_dirs", False)
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    _assert_same(_load(path, reader="stock"), _state(1))
    with pytest.raises(CheckpointException) as excinfo:
        _save(path, _state(2))
    assert "already holds a complete DCP checkpoint" in _message(excinfo)
    _assert_same(_load(path), _state(1))


def test_rank_local_saves_are_refused(tmp_path):
    with pytest.raises((CheckpointError, CheckpointException)) as excinfo:
        dcp.save(_state(1), storage_writer=StorageWriter(str(tmp_path / "s")), no_dist=True, use_collectives=False)
    assert "use_collectives=True" in _message(excinfo)


def test_a_folder_that_is_no_checkpoint_says_so(tmp_path):
    os.makedirs(tmp_path / "step-9")
    with pytest.raises(CheckpointException) as excinfo:
        _load(str(tmp_path / "step-9"))
    assert "holds no DCP checkpoint" in _message(excinfo)


def test_a_folder_name_that_cannot_be_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(InvalidTagError, match="not a plain folder name"):
        StorageWriter(str(tmp_path / "my ckpt"))


class _StallingWrites(DelegatingStorage):
    """A backend whose ``.distcp`` writes hang (a hung mount), for the writer's deadline."""

    def open_write(self, path: str):
        if path.endswith(".distcp"):
            time.sleep(3)
        return self.inner.open_write(path)


def test_a_stalled_write_raises_under_the_deadline_naming_the_file(tmp_path):
    path = str(tmp_path / "step-1")
    writer = StorageWriter(path, timeout=0.6)  # a stall is half the deadline without progress
    writer.place = dataclasses.replace(writer.place, root=_StallingWrites(writer.place.root))
    started = time.monotonic()
    with pytest.raises(CheckpointException) as excinfo:
        dcp.save(_state(1), storage_writer=writer, no_dist=True)
    assert time.monotonic() - started < 2.5
    assert "made no progress" in _message(
        excinfo
    ) and f"{layout.DCP_COMMIT.staging_dir('step-1')}/__0_0.distcp" in _message(excinfo)
    assert not os.path.exists(path)


def _item_range(path: str, fqn: str) -> tuple[int, int]:
    """``(offset, length)`` of ``fqn``'s bytes in its ``.distcp`` file."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    return info.offset, info.length


def _flip(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_damage_that_breaks_parsing_is_named_as_damage_and_no_value_is_committed(tmp_path):
    """The reader parses items as it streams the file; a parse failure still reports the file's failed check,
    and non-tensor values are loaded only after it passed."""
    path = str(tmp_path / "step-1")
    _save(path, _state(1))
    offset, _ = _item_range(path, "w")
    _flip(os.path.join(path, "__0_0.distcp"), offset)  # the item's zip header: torch.load fails on it
    out = _empty()
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
    assert f"{path}/__0_0.distcp is corrupt" in _message(excinfo) and "checksum" in _message(excinfo)
    assert out["nested"]["step"] == -1 and out["nested"]["name"] == ""


def test_a_partial_load_reads_and_checks_only_the_items_it_needs(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, _state(3))
    offset, length = _item_range(path, "w")
    _flip(os.path.join(path, "__0_0.distcp"), offset + length - 100)  # inside "w", which the first load skips
    part = {"ints": torch.zeros(10, dtype=torch.int64)}
    dcp.load(part, storage_reader=StorageReader(path), no_dist=True)  # its own blocks are intact
    assert torch.equal(part["ints"], _state(3)["ints"])
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load({"w": torch.zeros(16, 4)}, storage_reader=StorageReader(path), no_dist=True)
    assert f"{path}/__0_0.distcp is corrupt" in _message(excinfo)


class _CountingReads(DelegatingStorage):
    """Counts the bytes read of ``.distcp`` files (every read goes through ``open_read``: ranges, not streams)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.bytes_read = 0

    def local_path(self, path: str) -> None:
        return None  # every read it counts goes through open_read (a local file is mapped, past any counter)

    def open_sequential(self, path: str, direct: bool = False):
        assert not path.endswith(".distcp"), f"{path} read as a stream, not by range"
        return self.inner.open_sequential(path, direct)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        assert not path.endswith(".distcp"), f"{path} read outside open_read"
        return self.inner.read_bytes(path, offset, length)

    def open_read(self, path: str):
        counter = self

        class _Counted:
            def __init__(self, stream) -> None:
                self._stream = stream

            def seek(self, *args) -> int:
                return self._stream.seek(*args)

            def readinto(self, b) -> int:
                n = self._stream.readinto(b)
                counter.bytes_read += n if path.endswith(".distcp") else 0
                return n

        @contextlib.contextmanager
        def opened():
            with self.inner.open_read(path) as stream:
                yield _Counted(stream)

        return opened()


@pytest.mark.parametrize("with_manifests", [True, False])
def test_a_full_load_reads_each_byte_once(tmp_path, with_manifests):
    path = str(tmp_path / "step-1")
    _save(path, _state(1), thread_count=2)
    if not with_manifests:
        shutil.rmtree(os.path.join(path, "nxd_ckpt"))
    reader = StorageReader(path)
    counting = _CountingReads(reader.place.root)
    reader.place = dataclasses.replace(reader.place, root=counting)
    out = _empty()
    dcp.load(out, storage_reader=reader, no_dist=True)
    _assert_same(out, _state(1))
    sizes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))
    assert counting.bytes_read == sizes == reader.bytes_read
