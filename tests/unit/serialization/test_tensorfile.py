"""serialization/tensorfile.py: xser tensor files are torch.save files, byte for byte but for the serialization id,
written with the CRC-32 streamed per chunk; anything it cannot reproduce falls back to torch.save."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

from nxd_ckpt.serialization import tensorfile, xser

SID = "archive/.data/serialization_id"

TENSORS = {
    "f32": lambda: torch.arange(10, dtype=torch.float32),
    "0-d": lambda: torch.tensor(3.5),
    "empty": lambda: torch.zeros(0, 4),
    "bf16": lambda: torch.randn(100, 7).to(torch.bfloat16),
    "fp16": lambda: torch.randn(33).to(torch.float16),
    "int64 2-d": lambda: torch.arange(1000, dtype=torch.int64).reshape(10, 100),
    "bool": lambda: torch.rand(77) > 0.5,
    "uint8": lambda: torch.randint(0, 255, (5000,), dtype=torch.uint8),
    "several chunks": lambda: torch.rand((2 * tensorfile.CHUNK_BYTES + 12) // 4),
}


def _ours(t: torch.Tensor, line_up: bool = False) -> bytes:
    buf = io.BytesIO()
    tensorfile.save_tensor(t, buf, line_up_with_memory=line_up)
    return buf.getvalue()


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _without_id(data: bytes) -> bytes:
    """``data`` with the serialization id and its CRC-32 (descriptor and central directory) zeroed."""
    z = zipfile.ZipFile(io.BytesIO(data))
    info = z.getinfo(SID)
    out = bytearray(data)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    assert len(z.read(SID)) == 40
    out[start : start + 40] = b"0" * 40  # the id
    out[start + 44 : start + 48] = b"\0" * 4  # its data descriptor's CRC-32
    central = data.index(b"PK\x01\x02", z.start_dir) if hasattr(z, "start_dir") else data.rindex(b"PK\x01\x02")
    entry = data.index(SID.encode(), central) - 46  # the central directory entry of the id record
    out[entry + 16 : entry + 20] = b"\0" * 4
    return bytes(out)


@pytest.mark.parametrize("name", list(TENSORS))
def test_same_bytes_as_torch_save_but_the_serialization_id(name):
    t = TENSORS[name]()
    ours, theirs = _ours(t), _torch_save(t)
    assert len(ours) == len(theirs)
    assert _without_id(ours) == _without_id(theirs)
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None  # every CRC-32 is right
    assert zipfile.ZipFile(io.BytesIO(ours)).read(SID).isdigit()


@pytest.mark.parametrize("name", list(TENSORS))
@pytest.mark.parametrize("line_up", [False, True])
def test_reads_back_with_torch_load_and_our_readers(name, line_up):
    t = TENSORS[name]()
    data = _ours(t, line_up)
    for loaded in (
        torch.load(io.BytesIO(data), weights_only=True),
        xser.load_tensor(io.BytesIO(data), what="t.pt"),
        xser.load_tensor_buffer(np.frombuffer(bytearray(data), dtype=np.uint8), what="t.pt"),
    ):
        assert loaded.dtype == t.dtype and loaded.shape == t.shape and torch.equal(loaded, t)


def test_data_is_streamed_in_chunks_not_copied_whole():
    t = torch.rand((3 * tensorfile.CHUNK_BYTES) // 4)
    sizes: list[int] = []

    class Sink(io.BytesIO):
        def write(self, data):  # type: ignore[override]
            sizes.append(memoryview(data).nbytes)
            return super().write(data)

    tensorfile.save_tensor(t, Sink())
    assert max(sizes) == tensorfile.CHUNK_BYTES and sizes.count(tensorfile.CHUNK_BYTES) == 3


def test_huge_archives_fall_back_to_torch_save(monkeypatch):
    """Archives needing zip64 sizes are left to torch.save (which is deterministic for the same tensor)."""
    monkeypatch.setattr(tensorfile, "_ZIP32_LIMIT", 1000)
    t = torch.rand(1000)
    assert _ours(t) == _torch_save(t)


def test_a_changed_private_torch_api_falls_back_to_torch_save(monkeypatch):
    real_save = torch.serialization._save

    def changed(obj, zip_file, *args):  # a torch whose _save no longer takes what we pass
        if isinstance(zip_file, tensorfile._Recorder):
            raise TypeError("_save() got an unexpected argument")
        return real_save(obj, zip_file, *args)

    monkeypatch.setattr(torch.serialization, "_save", changed)
    t = torch.rand(50)
    assert torch.equal(torch.load(io.BytesIO(_ours(t)), weights_only=True), t)


def test_crc32_is_the_zip_crc():
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    assert tensorfile.crc32(data) == zlib.crc32(data)
    assert tensorfile.crc32(data[1000:], tensorfile.crc32(data[:1000])) == zlib.crc32(data)


def test_large_tensor_data_is_lined_up_with_its_memory_for_zero_copy_writes():
    """The data record starts at a file offset congruent to the tensor's address modulo the page (and still
    64-byte aligned); the file holds the same records as torch.save's and differs only in that padding."""
    for numel in (tensorfile.LINE_UP_MIN_BYTES // 4, 3 << 20):
        t = torch.rand(numel)
        ours = _ours(t, line_up=True)
        info = zipfile.ZipFile(io.BytesIO(ours)).getinfo("archive/data/0")
        name_len, extra_len = struct.unpack("<HH", ours[info.header_offset + 26 : info.header_offset + 30])
        data_offset = info.header_offset + 30 + name_len + extra_len
        assert data_offset % tensorfile.ALIGNMENT == 0
        assert data_offset % tensorfile.PAGE_BYTES == t.data_ptr() % tensorfile.PAGE_BYTES
        assert ours[data_offset : data_offset + t.numel() * 4] == t.numpy().tobytes()
        theirs = zipfile.ZipFile(io.BytesIO(_torch_save(t)))
        mine = zipfile.ZipFile(io.BytesIO(ours))
        assert mine.namelist() == theirs.namelist()
        for name in theirs.namelist():
            if name != SID:
                assert mine.read(name) == theirs.read(name), name
        assert mine.testzip() is None
