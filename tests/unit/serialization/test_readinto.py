"""Verified loads read every file from storage once: hashed and parsed from one in-memory buffer (no re-read),
with tensors sharing that buffer; damage is still detected and the file named."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.format import layout
from nxd_ckpt.serialization import plain, xser
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import ReadCountingStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

# Read more than once by design: the tag's metadata (resolving the tag, then checking its record) and manifests.
_BOOKKEEPING = ("/nxd_ckpt/", f"/{layout.METADATA_FILE}")


def _model_state() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(96, 64, generator=gen),
        "emb": torch.randn(50, 32, generator=gen).to(torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
    }


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_verified_load_reads_each_file_once_and_names_a_corrupt_one(tmp_path, monkeypatch, use_xser):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")  # a file per tensor
    ckpt = str(tmp_path / "ckpt")
    model = _model_state()
    net, opt, sched = make_training(seed=3)
    train_steps(net, opt, sched, steps=2, seed=3)
    nxd.save_checkpoint(ckpt, "step_2", model=model, optimizer=opt, scheduler=sched, use_xser=use_xser)

    storage = ReadCountingStorage(ckpt)
    model2: dict = {}
    _, opt2, sched2 = make_training(seed=11)
    nxd.load_checkpoint(storage, model=model2, optimizer=opt2, scheduler=sched2)  # verify=True (default)
    assert_state_equal(model, model2)
    assert_state_equal(opt.state_dict(), opt2.state_dict())

    data_files = {p: n for p, n in storage.bytes_read.items() if not any(b in p for b in _BOOKKEEPING)}
    sizes = {p: os.path.getsize(os.path.join(ckpt, p)) for p in data_files}
    assert data_files == sizes  # every byte read exactly once (the old verified load read each file twice)
    on_disk = set(LocalStorage(ckpt).walk_files("step_2"))
    assert {p for p in on_disk if ".tensors/" in p} == {p for p in data_files if ".tensors/" in p}  # all read
    assert len([p for p in data_files if ".tensors/" in p]) >= (len(model) if use_xser else 0)
    assert any("/model/" in p for p in data_files) and any("/optim/" in p for p in data_files)

    victim = max(data_files, key=lambda p: sizes[p])  # a tensor file (xser) or the model/optimizer file (plain)
    with open(os.path.join(ckpt, victim), "r+b") as f:
        f.seek(sizes[victim] - 200)  # inside the tensor data, before the zip directory
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(IntegrityError) as raised:
        nxd.load_checkpoint(ReadCountingStorage(ckpt), model={}, optimizer=make_training(seed=0)[1])
    assert f"{ckpt}/{victim} is corrupt" in str(raised.value)


def _saved(obj, path) -> np.ndarray:
    torch.save(obj, path)
    return LocalStorage(os.path.dirname(path)).read_buffer(os.path.basename(path))


def _inside(tensor: torch.Tensor, buffer: np.ndarray) -> bool:
    start = buffer.ctypes.data
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + buffer.nbytes


def test_tensors_share_the_file_buffer_and_misaligned_records_are_copied(tmp_path):
    t = torch.randn(33, 5)
    buffer = _saved(t, str(tmp_path / "t.pt"))
    loaded = xser.load_tensor_buffer(buffer, what="t.pt")
    assert torch.equal(loaded, t) and _inside(loaded, buffer)  # zero-copy
    assert loaded.storage_offset() == 0 and loaded.untyped_storage().nbytes() == t.nbytes  # owns exactly its bytes
    del buffer
    loaded.add_(1)  # still alive and writable once the loader's reference is gone
    assert torch.equal(loaded, t + 1)

    shifted = np.empty(_saved(t, str(tmp_path / "t.pt")).nbytes + 1, dtype=np.uint8)[1:]  # odd address
    shifted[:] = _saved(t, str(tmp_path / "t.pt"))
    copied = xser.load_tensor_buffer(shifted, what="t.pt")
    assert torch.equal(copied, t) and not _inside(copied, shifted) and copied.data_ptr() % 4 == 0

    state = {"a": torch.randn(40, 3), "n": 3, "half": torch.ones(9, dtype=torch.float16)}
    state["view"] = state["a"][5:9]
    buffer = _saved(state, str(tmp_path / "p.pt"))
    out = plain.load_buffer(buffer, what="p.pt")
    assert_state_equal(state, out)
    assert _inside(out["a"], buffer) and _inside(out["half"], buffer)
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()  # storage shared
