"""load/reshard_sources.py: blocks of saved tensors read by byte range from plain and xser files (views
with offsets and strides included), exactly the bytes of the block, and DP-chunked (ZeRO-1) sources."""

from __future__ import annotations

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.format import integrity, layout
from nxd_ckpt.format.sharding import TensorSharding, split
from nxd_ckpt.load import reshard_sources, zero1
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import ReadCountingStorage

BOXES = [((0, 6), (0, 10)), ((2, 4), (0, 10)), ((0, 6), (3, 7)), ((5, 6), (9, 10))]


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    base = torch.arange(80, dtype=torch.float32).reshape(8, 10)
    state = {"whole": base[:6].clone(), "offset": base[2:], "strided": base.t()[:, :6].t()}
    for encoding in ("plain", "xser"):
        nxd.save_checkpoint(tmp_path / encoding, "t", model=dict(state), use_xser=encoding == "xser")
    return tmp_path, state


@pytest.mark.parametrize("encoding", ["plain", "xser"])
@pytest.mark.parametrize("box", BOXES)
def test_read_box_returns_the_block(saved, encoding, box):
    root, state = saved
    storage = ReadCountingStorage(root / encoding)
    f = reshard_sources.SourceFile(storage, layout.model_file("t", 0, 0))
    for name in ("whole", "offset", "strided"):
        value = f.lookup((name,))
        assert f.meta(value) == (torch.float32, (6, 10))
        got = f.read_box(value, box)
        assert torch.equal(got, state[name][box[0][0] : box[0][1], box[1][0] : box[1][1]]), name


def test_plain_box_reads_only_its_bytes(saved):
    root, _ = saved
    storage = ReadCountingStorage(root / "plain")
    f = reshard_sources.SourceFile(storage, layout.model_file("t", 0, 0))
    path = layout.model_file("t", 0, 0)
    before = storage.bytes_read.get(path, 0)
    f.read_box(f.lookup(("whole",)), ((0, 6), (3, 7)))  # 6 runs of 4 floats
    assert storage.bytes_read[path] - before == 6 * 4 * 4


def test_missing_entry_and_file_are_named(saved):
    root, _ = saved
    f = reshard_sources.SourceFile(ReadCountingStorage(root / "plain"), layout.model_file("t", 0, 0))
    with pytest.raises(nxd.FormatError, match="no entry 'nope'"):
        f.lookup(("nope",))
    with pytest.raises(nxd.FormatError, match="missing"):
        reshard_sources.SourceFile(ReadCountingStorage(root / "plain"), layout.model_file("t", 1, 0))


def test_fill_from_dp_chunked_sources(saved, tmp_path):
    """A TP-local tensor stored as ZeRO-1 chunks (padded), re-cut for another TP rank and DP chunk."""
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    s = TensorSharding((6, 4), 1, 1, 1)
    chunks = {f"c{d}": zero1.shard_tensor(full, 4, d) for d in range(4)}  # 2 rows each (padded to 8)
    nxd.save_checkpoint(tmp_path / "z", "t", model=chunks)
    f = reshard_sources.SourceFile(ReadCountingStorage(tmp_path / "z"), layout.model_file("t", 0, 0))
    read = reshard_sources.chunked_reader(6, [(f, f.lookup((f"c{d}",))) for d in range(4)])
    for dst_tp, dst_rank in ((2, 0), (2, 1), (4, 3)):
        local = split(full, s, dst_tp, dst_rank)
        for dp, dp_rank in ((1, 0), (2, 1), (4, 2)):
            rows = zero1.shard_rows(6, dp, dp_rank)
            out = torch.zeros(zero1.shard_shape(local.shape, dp))
            part = out.narrow(0, 0, rows[1] - rows[0])
            reshard_sources.fill(part, s, 1, dst_tp, dst_rank, lambda _r, box: read(box), rows)
            assert torch.equal(out, zero1.shard_tensor(local, dp, dp_rank)), (dst_tp, dst_rank, dp, dp_rank)


def test_a_file_read_in_parts_is_checked_against_its_recorded_size(saved):
    root, _ = saved
    path = layout.model_file("t", 0, 0)
    storage = integrity.VerifyingStorage(LocalStorage(root / "plain"), "t")
    reshard_sources.SourceFile(storage, path)  # intact: fine
    with open(root / "plain" / path, "ab") as f:
        f.write(b"x")
    with pytest.raises(nxd.IntegrityError, match=r"corrupt: it has \d+ bytes but \d+ were written"):
        reshard_sources.SourceFile(storage, path)


def _data_offset(file, name: str) -> int:
    """Byte offset in ``file`` of the tensor ``name``'s first element (a plain torch.save file)."""
    from nxd_ckpt.serialization import structure

    with open(file, "rb") as f:
        state, offsets = structure.load_layout(f, str(file))
    meta = state[name]
    key = getattr(meta.untyped_storage(), structure.RECORD_ATTR)
    return offsets[key] + meta.storage_offset() * meta.element_size()


def _flip_at(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x08]))


@pytest.mark.parametrize("manifest", ["blocks", "whole-file only"])
def test_a_part_read_by_range_is_checked_before_it_is_returned(saved, manifest):
    """A re-sharded load reads parts of files: a flipped byte in the part it reads raises IntegrityError naming
    the file (checked by its blocks; a manifest from before block digests checks the whole file first)."""
    from nxd_ckpt.format import manifests

    root, state = saved
    path = layout.model_file("t", 0, 0)
    file = root / "plain" / path
    if manifest != "blocks":
        for m in (root / "plain" / "t" / "nxd_ckpt").iterdir():
            rank, records = manifests.parse_manifest(m.read_bytes(), str(m))
            m.write_bytes(manifests.manifest_bytes("t", rank, {p: manifests.FileRecord(r.size, r.digest, rank)
                                                               for p, r in records.items()}))  # fmt: skip
    box = ((2, 4), (0, 10))
    intact = reshard_sources.SourceFile(integrity.VerifyingStorage(LocalStorage(root / "plain"), "t"), path)
    assert torch.equal(intact.read_box(intact.lookup(("whole",)), box), state["whole"][2:4])
    _flip_at(file, _data_offset(file, "whole") + 3 * 10 * 4 + 5)  # row 3: inside the box
    with pytest.raises(nxd.IntegrityError, match=f"{path} is corrupt"):  # a small file: its one block
        f = reshard_sources.SourceFile(integrity.VerifyingStorage(LocalStorage(root / "plain"), "t"), path)
        f.read_box(f.lookup(("whole",)), box)
    unchecked = reshard_sources.SourceFile(LocalStorage(root / "plain"), path)  # no manifests asked: as before
    assert not torch.equal(unchecked.read_box(unchecked.lookup(("whole",)), box), state["whole"][2:4])


def test_an_xser_tensor_file_read_in_parts_is_checked(saved):
    root, _ = saved
    path = layout.model_file("t", 0, 0)
    f = reshard_sources.SourceFile(integrity.VerifyingStorage(LocalStorage(root / "xser"), "t"), path)
    value = f.lookup(("whole",))
    tensor_file = root / "xser" / f._tensor_path(int(value.tid))
    _flip_at(tensor_file, _data_offset(tensor_file, next(iter(_keys(tensor_file)))) + 3 * 10 * 4 + 1)
    with pytest.raises(nxd.IntegrityError, match="is corrupt"):
        f.read_box(value, ((2, 4), (0, 10)))


def _keys(file) -> list:
    from nxd_ckpt.serialization import structure

    with open(file, "rb") as fh:
        state, _ = structure.load_layout(fh, str(file))
    return list(state) if isinstance(state, dict) else [None]


@pytest.mark.parametrize("row", [105, 400])
def test_a_part_of_a_large_tensor_is_checked_by_its_own_blocks(tmp_path, row):
    """Only the blocks a part needs are read and checked: a flipped byte in it raises, one elsewhere does not."""
    big = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)  # 2 MiB: several blocks
    nxd.save_checkpoint(tmp_path, "t", model={"big": big})
    path = layout.model_file("t", 0, 0)
    file = tmp_path / path
    _flip_at(file, _data_offset(file, "big") + row * 1024 * 4 + 17)
    storage = ReadCountingStorage(tmp_path)
    f = reshard_sources.SourceFile(integrity.VerifyingStorage(storage, "t"), path)
    box = ((100, 110), (0, 1024))
    if row == 105:
        with pytest.raises(nxd.IntegrityError, match=f"{path} is corrupt: its bytes"):
            f.read_box(f.lookup(("big",)), box)
        return
    assert torch.equal(f.read_box(f.lookup(("big",)), box), big[100:110])
    assert storage.bytes_read[path] < big.numel() * big.element_size() / 2  # its blocks, not the file
