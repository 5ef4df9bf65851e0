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
