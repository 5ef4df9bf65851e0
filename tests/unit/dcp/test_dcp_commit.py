"""nxd_ckpt.dcp's one commit round and ``.metadata``'s check, in one process: the ranks' records reach the commit
through DCP's own results (no manifest is read back), a load plans from one index and ``.metadata``'s record at a
fixed place (no listing), and a damaged or missing ``.metadata`` fails ``dcp.load`` with the reader's
IntegrityError, once, not DCP's bare AssertionError after a retry of rank-local metadata."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.errors import IntegrityError, MissingFileError
from nxd_ckpt.format import layout
from nxd_ckpt.format.manifests import FileRecord, index_bytes, manifest_bytes, parse_index
from nxd_ckpt.storage import DelegatingStorage, Storage

pytestmark = pytest.mark.device_independent  # file protocol over CPU tensors: runs once, in the CPU lane


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        yield


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(64, 8), "b": torch.zeros(8), "step": -1}


def _save(path: str, seed: int) -> None:
    dcp.save(_state(seed), storage_writer=StorageWriter(path), no_dist=True)


class _Recording(DelegatingStorage):
    """Every path read, opened or listed through it, in order (``calls``: (operation, path))."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, str]] = []

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self.calls.append(("read", path))
        return self.inner.read_bytes(path, offset, length)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self.calls.append(("read", path))
        return self.inner.open_read(path)

    def open_sequential(self, path: str, direct: bool = False) -> AbstractContextManager[BinaryIO]:
        self.calls.append(("read", path))
        return self.inner.open_sequential(path, direct)

    def list_dir(self, path: str) -> list[str]:
        self.calls.append(("list", path))
        return self.inner.list_dir(path)

    def exists(self, path: str) -> bool:
        self.calls.append(("exists", path))
        return self.inner.exists(path)


def _recorded(obj: Any) -> _Recording:
    """Route ``obj``'s (a writer's or reader's) storage through a ``_Recording``."""
    recording = _Recording(obj.place.root)
    obj.place = dataclasses.replace(obj.place, root=recording)
    return recording


def test_the_commit_reads_no_manifest_back_and_writes_one_index(tmp_path):
    path = str(tmp_path / "step-1")
    writer = StorageWriter(path)
    recording = _recorded(writer)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    manifests = [c for c in recording.calls if "manifest_rank_" in c[1] or c[1].endswith("/nxd_ckpt")]
    assert manifests == [], manifests  # the records came through DCP's results
    index = parse_index((tmp_path / "step-1" / "nxd_ckpt" / "dcp_index.json").read_bytes(), "index")
    assert sorted(index) == [".metadata", "__0_0.distcp"]
    assert index["__0_0.distcp"].size == os.path.getsize(tmp_path / "step-1" / "__0_0.distcp")
    # stock readers see DCP's own records only: the ranks' records never reach .metadata
    metadata = pickle.loads((tmp_path / "step-1" / ".metadata").read_bytes())
    assert {type(info) for info in metadata.storage_data.values()} == {_StorageInfo}
    got = _empty()
    dcp.load(got, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert torch.equal(got["w"], _state(1)["w"]) and got["step"] == 1


def test_load_planning_lists_nothing_and_reads_one_index(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    reader = StorageReader(path)
    recording = _recorded(reader)
    got = _empty()
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert torch.equal(got["w"], _state(1)["w"]) and got["step"] == 1
    assert [c for c in recording.calls if c[0] == "list"] == []
    reads = [c[1] for c in recording.calls if c[0] == "read"]
    assert reads[:3] == [
        "step-1/nxd_ckpt/dcp_metadata.json",
        "step-1/.metadata",
        "step-1/nxd_ckpt/dcp_index.json",
    ], reads
    assert set(reads[3:]) <= {"step-1/__0_0.distcp"}, reads  # the data (a local file is mapped, not opened)


def test_a_checkpoint_without_the_index_still_loads_verified_from_its_manifests(tmp_path):
    """Checkpoints written before the index and ``.metadata``'s fixed record: the manifests vouch for them."""
    path = str(tmp_path / "step-1")
    _save(path, 1)
    os.remove(tmp_path / "step-1" / "nxd_ckpt" / "dcp_index.json")
    os.remove(tmp_path / "step-1" / "nxd_ckpt" / "dcp_metadata.json")
    got = _empty()
    dcp.load(got, storage_reader=StorageReader(path), no_dist=True)
    assert torch.equal(got["w"], _state(1)["w"])
    _flip(str(tmp_path / "step-1" / ".metadata"))
    with pytest.raises(IntegrityError, match=r"\.metadata is corrupt"):
        StorageReader(path).read_metadata()


def _flip(file: str) -> None:
    with open(file, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(bytes(data))


def test_a_damaged_metadata_fails_dcp_load_with_the_readers_integrity_error_once(tmp_path, caplog):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    _flip(os.path.join(path, ".metadata"))
    with pytest.raises(IntegrityError, match=r"step-1/\.metadata is corrupt.*dcp_metadata\.json|step-1/\.metadata"):
        StorageReader(path).read_metadata()
    got = _empty()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointException) as raised:
        dcp.load(got, storage_reader=StorageReader(path), no_dist=True)
    (error, _), *others = raised.value.failures.values()
    assert others == [] and isinstance(error, IntegrityError), raised.value.failures
    assert f"{path}/.metadata is corrupt" in str(error)
    assert "metadata is not found" not in caplog.text  # DCP's retry of rank-local metadata never ran
    assert got["step"] == -1 and not got["w"].any()


def test_a_missing_metadata_the_records_list_is_damage_not_a_missing_checkpoint(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(MissingFileError, match=r"step-1/\.metadata is missing, but the checkpoint's records list it"):
        StorageReader(path).read_metadata()
    with pytest.raises(CheckpointException) as raised:
        dcp.load(_empty(), storage_reader=StorageReader(path), no_dist=True)
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, MissingFileError) and isinstance(error, FileNotFoundError)


def test_a_damaged_metadata_record_is_named(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    _flip(os.path.join(path, "nxd_ckpt", "dcp_metadata.json"))
    with pytest.raises(IntegrityError, match=r"dcp_metadata\.json is damaged"):
        StorageReader(path).read_metadata()


def test_read_metadata_has_no_rank_local_path(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    with pytest.raises(TypeError):
        StorageReader(path).read_metadata(rank=0)  # type: ignore[call-arg]


def test_the_index_carries_each_ranks_manifest_and_names_damage():
    per_rank = {r: {f"__{r}_0.distcp": FileRecord(10 + r, f"{r:016x}", r)} for r in range(3)}
    data = index_bytes("step-1", [manifest_bytes("step-1", r, recs) for r, recs in per_rank.items()])
    assert parse_index(data, "i") == {rel: rec for recs in per_rank.values() for rel, rec in recs.items()}
    damaged = data.replace(b"[11,", b"[12,")
    assert damaged != data
    with pytest.raises(IntegrityError, match="manifest i is damaged"):
        parse_index(damaged, "i")
    with pytest.raises(IntegrityError, match="index i is damaged"):
        parse_index(manifest_bytes("step-1", 0, per_rank[0]), "i")
    assert layout.dcp_index_file("step-1") == "step-1/nxd_ckpt/dcp_index.json"


def test_a_flipped_byte_anywhere_in_metadata_is_an_integrity_error(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, 1)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        original = f.read()
    for pos in range(0, len(original), max(1, len(original) // 40)):
        with open(meta, "wb") as f:
            f.write(original[:pos] + bytes([original[pos] ^ 0x10]) + original[pos + 1 :])
        with pytest.raises(CheckpointException) as raised:
            dcp.load(_empty(), storage_reader=StorageReader(path), no_dist=True)
        (error, _), *_ = raised.value.failures.values()
        assert isinstance(error, IntegrityError), (pos, error)


def test_metadata_that_is_not_dcps_is_named_as_damage_without_records(tmp_path):
    """A stock checkpoint (no records) whose ``.metadata`` unpickles to something else, or not at all."""
    path = str(tmp_path / "step-1")
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        original = f.read()
    for data in (pickle.dumps([1, 2]), b"\x9c" + original[1:]):
        with open(meta, "wb") as f:
            f.write(data)
        with pytest.raises(IntegrityError, match=r"\.metadata is damaged and cannot be read"):
            StorageReader(path).read_metadata()
