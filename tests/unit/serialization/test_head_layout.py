"""``structure.head_layout``: a torch.save file's tensor layout and record offsets from its first bytes alone,
the same as ``load_layout`` (which walks the zip directory at the end), or None where the head does not say."""

from __future__ import annotations

import io

import torch

from nxd_ckpt.format.manifests import HEAD_BYTES
from nxd_ckpt.serialization import structure


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _described(found) -> tuple:
    saved, offsets = found
    key = getattr(saved.untyped_storage(), structure.RECORD_ATTR)
    return saved.dtype, tuple(saved.size()), saved.stride(), saved.storage_offset(), key, offsets


def test_the_head_gives_what_the_directory_gives():
    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    for tensor in (base, base.t().contiguous(), base.to(torch.bfloat16), base.t().clone(), torch.zeros(3, 0)):
        blob = _saved(tensor)
        found = structure.head_layout(blob[:HEAD_BYTES], "t")
        assert found is not None
        assert _described(found) == _described(structure.load_layout(io.BytesIO(blob), "t"))
        saved, offsets = found
        start = next(iter(offsets.values()))
        if tensor.is_contiguous() and tensor.numel():
            data = blob[start : start + saved.untyped_storage().nbytes()]
            assert data == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_record_past_the_head_or_a_cut_head_says_nothing():
    two = _saved({"a": torch.zeros(1 << 16), "b": torch.ones(4)})  # b's record is 256 KiB in
    assert structure.head_layout(two[:HEAD_BYTES], "t") is None
    one = _saved(torch.ones(8))
    assert structure.head_layout(one[:40], "t") is None  # not even data.pkl's header whole
    assert structure.head_layout(b"not a zip file at all", "t") is None


def test_a_big_endian_file_is_left_to_the_directory_walk():
    blob = bytearray(_saved(torch.ones(8)))
    at = blob.find(b"little")
    assert at > 0
    blob[at : at + 6] = b"big\x00\x00\x00"
    assert structure.head_layout(bytes(blob[:HEAD_BYTES]), "t") is None
