"""nxd_ckpt.dcp.StorageReader checks each block before any byte is used, and reads only what the load needs
(issue 53): a damaged or truncated file leaves every target as it was and is named; a one-key load, a model-only
load of a model + AdamW checkpoint, and a load of part of a saved chunk read about their own bytes; checkpoints
whose manifests predate block digests still load and verify."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from nxd_ckpt import pages
from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.dcp import verify as verify_folder
from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.format import layout, manifests
from nxd_ckpt.storage import DelegatingStorage

pytestmark = pytest.mark.device_independent  # file protocol over CPU tensors: runs once, in the CPU lane

MB = 1 << 20


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        yield


def _save(path: str, state: dict) -> None:
    dcp.save(state, storage_writer=StorageWriter(path), no_dist=True)


class _Counting(DelegatingStorage):
    """Counts the bytes read of ``.distcp`` files, by any route."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.bytes_read = 0

    def _counted(self, opened, path: str):
        counter = self

        class _Stream:
            def __init__(self, stream) -> None:
                self._stream = stream

            def readinto(self, b) -> int:
                n = self._stream.readinto(b) or 0
                counter.bytes_read += n if path.endswith(".distcp") else 0
                return n

            def read(self, n: int = -1) -> bytes:
                data = self._stream.read(n)
                counter.bytes_read += len(data) if path.endswith(".distcp") else 0
                return data

            def __getattr__(self, name):
                return getattr(self._stream, name)

        @contextlib.contextmanager
        def wrapped():
            with opened as stream:
                yield _Stream(stream)

        return wrapped()

    def open_read(self, path: str):
        return self._counted(self.inner.open_read(path), path)

    def open_sequential(self, path: str, direct: bool = False):
        return self._counted(self.inner.open_sequential(path, direct), path)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        self.bytes_read += len(data) if path.endswith(".distcp") else 0
        return data

    def read_buffer(self, path: str, allocate=None):
        data = self.inner.read_buffer(path, allocate)
        self.bytes_read += data.nbytes if path.endswith(".distcp") else 0
        return data


def _load_counted(path: str, state: dict) -> int:
    """Load ``state`` through our reader; the bytes of ``.distcp`` files it read: through ``open_read`` (counted
    by the storage) or mapped from the page cache (counted by the files' reads). What it checked and then used
    again from the page cache is never more than that."""
    reader = StorageReader(path)
    counting = _Counting(reader.place.root)
    reader.place = dataclasses.replace(reader.place, root=counting)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert counting.bytes_read <= reader.bytes_read
    assert reader.bytes_reused <= reader.bytes_read
    return reader.bytes_read


def _items(path: str) -> dict[str, tuple[int, int]]:
    """``fqn -> (offset, length)`` of each item in the checkpoint's one ``.distcp`` file."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {k.fqn: (v.offset, v.offset + v.length) for k, v in metadata.storage_data.items()}


def _flip(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))


def _three(seed: int) -> dict:
    """Three tensors as in the issue: large, small, large (scaled down)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(1 << 20, generator=g),  # 4 MiB
        "b": torch.randn(2048, generator=g),  # 8 KiB
        "c": torch.randn(1 << 20, generator=g),
    }


def _minus_ones() -> dict:
    return {"a": torch.full((1 << 20,), -1.0), "b": torch.full((2048,), -1.0), "c": torch.full((1 << 20,), -1.0)}


@pytest.mark.parametrize("where", ["a:first", "a:middle", "b:middle", "c:middle", "c:last", "file:last"])
def test_a_flipped_byte_leaves_every_target_as_it_was_and_names_the_file(tmp_path, where):
    path = str(tmp_path / "step-1")
    _save(path, _three(1))
    items, file = _items(path), os.path.join(path, "__0_0.distcp")
    name, spot = where.split(":")
    if name == "file":
        offset = os.path.getsize(file) - 3
    else:
        start, end = items[name]
        offset = {"first": start + 40, "middle": (start + end) // 2, "last": end - 30}[spot]
    _flip(file, offset)
    targets = _minus_ones()
    before = {k: v.clone() for k, v in targets.items()}
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(targets, storage_reader=StorageReader(path), no_dist=True)
    assert f"{path}/__0_0.distcp is corrupt" in str(excinfo.value)
    (failure,) = excinfo.value.failures.values()
    assert isinstance(failure[0] if isinstance(failure, tuple) else failure, IntegrityError)
    for key, value in targets.items():
        assert torch.equal(value, before[key]), f"{key} was written by a load that failed"


@pytest.mark.parametrize("cut", [1, 3 * MB])
def test_a_truncated_file_leaves_every_target_as_it_was_and_names_the_file(tmp_path, cut):
    path = str(tmp_path / "step-1")
    _save(path, _three(2))
    file = os.path.join(path, "__0_0.distcp")
    os.truncate(file, os.path.getsize(file) - cut)
    targets = _minus_ones()
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(targets, storage_reader=StorageReader(path), no_dist=True)
    assert f"{path}/__0_0.distcp is corrupt" in str(excinfo.value) and "bytes but" in str(excinfo.value)
    assert all(torch.equal(v, torch.full_like(v, -1.0)) for v in targets.values())


def test_a_non_tensor_value_is_not_unpickled_from_a_damaged_file(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, {**_three(3), "extra": {"note": "x" * 5000}})
    start, end = _items(path)["extra.note"]
    _flip(os.path.join(path, "__0_0.distcp"), (start + end) // 2)
    targets = {**_minus_ones(), "extra": {"note": ""}}
    with pytest.raises(CheckpointException, match="is corrupt"):
        dcp.load(targets, storage_reader=StorageReader(path), no_dist=True)
    assert targets["extra"] == {"note": ""}
    assert torch.equal(targets["a"], torch.full_like(targets["a"], -1.0))


def test_a_one_key_load_of_a_large_file_reads_about_that_key(tmp_path):
    path = str(tmp_path / "step-1")
    g = torch.Generator().manual_seed(4)
    big = {f"w{i}": torch.randn(2 << 20, generator=g) for i in range(4)}  # 32 MiB in one file
    _save(path, {**big, "small": torch.arange(256, dtype=torch.float32)})  # 1 KiB
    out = {"small": torch.zeros(256)}
    read = _load_counted(path, out)
    assert torch.equal(out["small"], torch.arange(256, dtype=torch.float32))
    start, end = _items(path)["small"]
    assert read == end - start  # its own block: the item, nothing else


def _model_and_adamw(seed: int) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def test_a_model_only_load_of_a_model_and_adamw_checkpoint_reads_about_the_model(tmp_path):
    path = str(tmp_path / "step-1")
    model, optim = _model_and_adamw(5)
    _save(path, {"model": model, "optimizer": optim})
    out = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    read = _load_counted(path, out)
    assert all(torch.equal(out["model"][k], v) for k, v in model.items())
    model_bytes = sum(v.numel() * v.element_size() for v in model.values())
    file_bytes = os.path.getsize(os.path.join(path, "__0_0.distcp"))
    assert file_bytes > 2.5 * model_bytes  # the optimizer's moments are in the same file
    assert read <= 1.1 * model_bytes, (read, model_bytes)


def test_a_part_of_a_saved_chunk_reads_about_that_part(tmp_path):
    """What a load onto more ranks does (DCP asks for a part of each saved chunk): here half of a tensor's rows,
    by loading into a tensor of the same shape with ``storage_offsets`` (a DTensor would, on 2 ranks)."""
    path = str(tmp_path / "step-1")
    g = torch.Generator().manual_seed(6)
    full = torch.randn(64, 1 << 16, generator=g)  # 16 MiB, one chunk
    _save(path, {"w": full})
    reader = StorageReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    half = torch.zeros(32, 1 << 16)

    class _Planner:
        def resolve_tensor(self, item):
            return half

        def commit_tensor(self, item, tensor):
            pass

    item = ReadItem(
        type=LoadItemType.TENSOR,
        storage_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_index=MetadataIndex("w", torch.Size([32, 0])),
        storage_offsets=torch.Size([32, 0]),
        dest_offsets=torch.Size([0, 0]),
        lengths=torch.Size([32, 1 << 16]),
    )
    assert isinstance(metadata.state_dict_metadata["w"].chunks[0], ChunkStorageMetadata)
    (plan,) = reader.prepare_global_plan([LoadPlan([item])])
    counting = _Counting(reader.place.root)
    reader.place = dataclasses.replace(reader.place, root=counting)
    reader.read_data(plan, _Planner()).wait()
    assert torch.equal(half, full[32:])
    assert counting.bytes_read <= reader.bytes_read <= 1.1 * half.numel() * half.element_size()  # mapped: uncounted


def _as_version_1(path: str) -> None:
    """Rewrite the folder's manifests as a library without block digests wrote them (which wrote neither the
    combined index nor .metadata's fixed record either)."""
    folder = os.path.join(path, "nxd_ckpt")
    tag = os.path.basename(path)
    for extra in (layout.dcp_index_file(tag), layout.dcp_metadata_record_file(tag)):
        os.remove(os.path.join(os.path.dirname(path), extra))
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            rank, records = manifests.parse_manifest(f.read(), name)
        old = {rel: manifests.FileRecord(r.size, r.digest, rank) for rel, r in records.items()}
        data = manifests.manifest_bytes(os.path.basename(path), rank, old)
        assert json.loads(data)["format_version"] == 1 and all(len(v) == 2 for v in json.loads(data)["files"].values())
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)


def test_a_checkpoint_with_whole_file_digests_only_still_loads_and_verifies(tmp_path):
    path = str(tmp_path / "step-1")
    _save(path, _three(7))
    _as_version_1(path)
    assert verify_folder(path).ok
    out = _minus_ones()
    dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in _three(7).items())
    start, end = _items(path)["c"]
    _flip(os.path.join(path, "__0_0.distcp"), (start + end) // 2)
    assert not verify_folder(path).ok
    targets = _minus_ones()
    with pytest.raises(CheckpointException, match="__0_0.distcp is corrupt"):  # the one key it reads is intact
        dcp.load({"b": targets["b"]}, storage_reader=StorageReader(path), no_dist=True)
    assert torch.equal(targets["b"], torch.full_like(targets["b"], -1.0))


def test_a_load_larger_than_its_buffer_is_checked_whole_before_any_target_changes(tmp_path, monkeypatch):
    """Past ``buffer_bytes`` the ranges are checked first and read again as they are used: the same guarantee,
    memory one item, twice the reads for what did not fit."""
    path = str(tmp_path / "step-1")
    _save(path, _three(8))
    out = _minus_ones()
    reader = StorageReader(path, buffer_bytes=1 << 20)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in _three(8).items())
    size = os.path.getsize(os.path.join(path, "__0_0.distcp"))
    assert size <= reader.bytes_read <= size + MB  # read once; what was not held is used from the page cache
    assert reader.bytes_reused == 0  # where it stayed locked in memory: not checked twice
    _flip(os.path.join(path, "__0_0.distcp"), _items(path)["c"][1] - 100)
    monkeypatch.setenv("NXD_CKPT_DCP_LOAD_BUFFER", "1MiB")  # the knob, when the keyword is not given
    targets = _minus_ones()
    with pytest.raises(CheckpointException, match="__0_0.distcp is corrupt"):
        dcp.load(targets, storage_reader=StorageReader(path), no_dist=True)
    assert all(torch.equal(v, torch.full_like(v, -1.0)) for v in targets.values())


def test_bad_reader_options_are_refused():
    with pytest.raises(ValueError, match="thread_count must be a positive int"):
        StorageReader("/tmp/x", thread_count=0)
    with pytest.raises(TypeError, match="buffer_bytes must be an int"):
        StorageReader("/tmp/x", buffer_bytes="1GiB")


@pytest.mark.parametrize("locked", [True, False])
def test_a_local_load_holds_no_copy_and_checks_again_only_what_was_not_kept(tmp_path, monkeypatch, locked):
    """Local files are checked where the page cache holds them, those pages locked in memory, then used from
    there: each byte read from storage once, no copy of the load held (no fresh memory to fault in). Where the
    kernel refuses the lock (``RLIMIT_MEMLOCK``) the pages may be dropped and read again, so each block is
    checked again as it is used."""
    if not locked:
        monkeypatch.setattr(pages, "lock", lambda start, end: False)
    path = str(tmp_path / "step-1")
    state = _three(9)
    _save(path, state)
    out = _minus_ones()
    reader = StorageReader(path)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    size = os.path.getsize(os.path.join(path, "__0_0.distcp"))
    assert size - MB <= reader.bytes_read <= size
    assert reader.bytes_reused == 0 if locked else size - MB <= reader.bytes_reused <= size
    held = StorageReader(path, buffer_bytes=1 << 30)  # asked to hold: read once, used from its own copy
    dcp.load(_minus_ones(), storage_reader=held, no_dist=True)
    assert held.bytes_reused == 0 and size - MB <= held.bytes_read <= size


def test_pages_not_kept_are_checked_again_as_they_are_used(tmp_path, monkeypatch):
    """With the lock refused, a byte that changes between the check and the use (the page dropped and read
    back damaged) is found by the second check, naming the file."""
    from nxd_ckpt.format.integrity import MappedSpan

    monkeypatch.setattr(pages, "lock", lambda start, end: False)
    path = str(tmp_path / "step-1")
    _save(path, _three(10))
    start, end = _items(path)["c"]
    checked = MappedSpan.check

    def check_then_damage(span, a, b):
        checked(span, a, b)
        if a <= (start + end) // 2 < b:
            _flip(os.path.join(path, "__0_0.distcp"), (start + end) // 2)

    monkeypatch.setattr(MappedSpan, "check", check_then_damage)
    with pytest.raises(CheckpointException, match="__0_0.distcp is corrupt"):
        dcp.load(_minus_ones(), storage_reader=StorageReader(path), no_dist=True)


def test_a_load_unmaps_its_files_as_it_ends(tmp_path):
    """The page cache's pages a load kept locked are let go when it returns (failed or not), not whenever the
    collector gets to them."""
    path = str(tmp_path / "step-1")
    _save(path, _three(11))
    data = os.path.join(path, "__0_0.distcp")

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return data in f.read()

    dcp.load(_minus_ones(), storage_reader=StorageReader(path), no_dist=True)
    assert not mapped()
    _flip(data, _items(path)["c"][1] - 100)
    with pytest.raises(CheckpointException, match="__0_0.distcp is corrupt"):
        dcp.load(_minus_ones(), storage_reader=StorageReader(path), no_dist=True)
    assert not mapped()
