"""xser encoding in one process: round trips, the exact layout torch_xla/NxD expect, reading without torch_xla,
torch_xla-style files (inline CPU tensors, no info file), size balancing, and damaged files."""

from __future__ import annotations

import argparse
import collections
import io
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from nxd_ckpt import statefile
from nxd_ckpt.errors import FormatError, UnsafeCheckpointError
from nxd_ckpt.serialization import xser
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

PATH = "step_1/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


@pytest.fixture(autouse=True)
def _a_file_per_tensor(monkeypatch):
    """These tests use tiny tensors and check the one-file-per-tensor layout: turn inlining off."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")


def _nested_state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.randn(3, 3)
    return {
        "weights": collections.OrderedDict(w=torch.randn(5, 4), b=torch.zeros(4)),
        "shared_a": shared,
        "shared_b": shared,
        "view_row": base[1],  # a view into a 24-element storage
        "view_t": base.t(),  # non-contiguous
        "dtypes": [
            torch.randn(3).to(torch.bfloat16),
            torch.randn(3).to(torch.float16),
            torch.arange(5, dtype=torch.int64),
            torch.tensor([True, False]),
            torch.arange(4, dtype=torch.int8),
        ],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "pair": (torch.ones(2), "label", 7),
        "leaves": {"step": 12, "lr": 1e-3, "name": "adamw", "betas": (0.9, 0.999), "none": None},
    }


def _write(tmp_path, state, replicas=(0,), rank=0) -> statefile.WrittenFiles:
    storage = LocalStorage(tmp_path)
    return statefile.write_state_file(storage, PATH, state, xser_encoding=True, replicas=replicas, rank=rank)


def test_round_trip_keeps_structure_values_and_sharing(tmp_path):
    state = _nested_state()
    written = _write(tmp_path, state)
    storage = LocalStorage(tmp_path)
    assert statefile.is_xser_file(storage, PATH)
    loaded = statefile.read_state_file(storage, PATH)
    assert_state_equal(state, loaded)
    assert type(loaded["weights"]) is collections.OrderedDict
    assert isinstance(loaded["pair"], tuple) and loaded["pair"][1:] == ("label", 7)
    assert loaded["leaves"] == state["leaves"]
    assert loaded["shared_a"] is loaded["shared_b"]  # one tid, one tensor
    assert loaded["dtypes"][0].dtype == torch.bfloat16 and loaded["scalar"].dim() == 0
    tensor_files = [p for p in written.paths if ".tensors/" in p]
    distinct = len({id(t) for t in _tensors(state)})
    assert len(tensor_files) == distinct
    assert written.nbytes == sum(t.numel() * t.element_size() for t in {id(t): t for t in _tensors(state)}.values())


def _tensors(obj):
    from nxd_ckpt.tree import iter_tensors

    return [t for _, t in iter_tensors(obj)]


def test_layout_matches_torch_xla(tmp_path):
    """tids in depth-first order, views stored compacted, tensor files loadable with weights_only, the info file
    NxD writes, and a reference file naming torch_xla's class."""
    state = _nested_state()
    _write(tmp_path, state)
    root = tmp_path / PATH
    tensors_dir = str(root) + ".tensors"
    order = list({id(t): t for t in _tensors(state)}.values())
    for tid, expected in enumerate(order):
        t = torch.load(os.path.join(tensors_dir, f"tensor_{tid}.pt"), weights_only=True)
        assert t.dtype == expected.dtype and torch.equal(t, expected.contiguous())
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # compacted, as torch_xla does
    info = torch.load(str(root) + ".info.pt", weights_only=True)
    assert sorted(info) == list(range(len(order)))
    assert info[0] == {"dtype": torch.float32, "shape": torch.Size([5, 4]), "expert_model_parallel": False}
    with zipfile.ZipFile(root) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        assert not any("/data/" in n for n in z.namelist())  # no tensor data inside the reference file
    assert b"ctorch_xla.utils.serialization\nTensorReference\n" in pickled


def test_reference_file_reads_without_torch_xla(tmp_path):
    """A fresh interpreter where ``import torch_xla`` fails reads the file with nxd_ckpt and with plain torch."""
    state = {"a": torch.randn(4, 2), "b": [torch.arange(3)], "n": 3}
    _write(tmp_path, state)
    script = f"""
import sys
sys.modules["torch_xla"] = None  # any import of torch_xla now raises ImportError
import torch
from nxd_ckpt import statefile
from nxd_ckpt.save import plan
from nxd_ckpt.serialization import xser
from nxd_ckpt.storage import LocalStorage
s = statefile.read_state_file(LocalStorage({str(tmp_path)!r}), {PATH!r})
assert s["n"] == 3 and s["a"].shape == (4, 2) and s["b"][0].tolist() == [0, 1, 2]
with torch.serialization.safe_globals([xser.TensorReference]):
    ref = torch.load({str(tmp_path / PATH)!r}, weights_only=True)
assert ref["a"].tid == 0 and ref["b"][0].tid == 1
assert "torch_xla" not in {{k for k, v in sys.modules.items() if v is not None}}
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_torch_xla_style_file_with_inline_cpu_tensors_and_no_info(tmp_path):
    """torch_xla's save keeps CPU tensors inline in the reference file and writes no info file."""
    storage = LocalStorage(tmp_path)
    inline = torch.arange(6.0)
    ref_data = {"xla_t": xser.TensorReference(0), "cpu_t": inline, "nested": [xser.TensorReference(1)]}
    with storage.open_write(PATH) as f:
        xser.save_ref(ref_data, f)
    for tid, t in enumerate([torch.ones(2, 2), torch.zeros(3, dtype=torch.int32)]):
        with storage.open_write(f"{PATH}.tensors/tensor_{tid}.pt") as f:
            torch.save(t, f)
    loaded = statefile.read_state_file(storage, PATH)
    assert torch.equal(loaded["cpu_t"], inline)
    assert torch.equal(loaded["xla_t"], torch.ones(2, 2))
    assert loaded["nested"][0].dtype == torch.int32


def test_trusted_reader_maps_the_reference_class(tmp_path):
    state = {"a": torch.randn(3), "opaque": collections.Counter(x=1)}
    _write(tmp_path, state)
    loaded = statefile.read_state_file(LocalStorage(tmp_path), PATH, trusted=True)
    assert torch.equal(loaded["a"], state["a"]) and loaded["opaque"] == collections.Counter(x=1)


def test_untrusted_reader_refuses_pickled_code(tmp_path):
    storage = LocalStorage(tmp_path)
    with storage.open_write(PATH) as f:
        xser.save_ref({"x": xser.TensorReference(0), "c": argparse.Namespace(x=1)}, f)
    with storage.open_write(f"{PATH}.tensors/tensor_0.pt") as f:
        torch.save(torch.ones(1), f)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        statefile.read_state_file(storage, PATH)


def test_balance_splits_bytes_evenly_and_deterministically():
    sizes = [100, 90, 80, 10, 10, 5, 5, 0, 60, 40]
    parts = xser.balance(sizes, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(sizes) and xser.balance(sizes, 2) == parts
    assert xser.balance(sizes, 1) == [list(range(len(sizes)))]
    assert xser.balance([7], 3) == [[0], [], []]


def test_replicas_each_write_a_share_and_only_the_first_writes_ref_and_info(tmp_path):
    state = {f"w{i}": torch.randn(64 * (i + 1)) for i in range(6)}
    a = _write(tmp_path, state, replicas=(0, 2), rank=0)
    b = _write(tmp_path, state, replicas=(0, 2), rank=2)
    assert PATH in a.paths and PATH not in b.paths and f"{PATH}.info.pt" not in b.paths
    assert a.nbytes > 0 and b.nbytes > 0 and a.nbytes + b.nbytes == sum(t.numel() * 4 for t in state.values())
    assert not set(a.paths) & set(b.paths)
    assert_state_equal(state, statefile.read_state_file(LocalStorage(tmp_path), PATH))
    with pytest.raises(ValueError, match="not one of the replicas"):
        _write(tmp_path, state, replicas=(0, 2), rank=1)


def test_plain_write_removes_a_stale_xser_directory(tmp_path):
    storage = LocalStorage(tmp_path)
    _write(tmp_path, {"a": torch.ones(2)})
    statefile.write_state_file(storage, PATH, {"a": torch.zeros(2)}, xser_encoding=False)
    assert not statefile.is_xser_file(storage, PATH)
    assert torch.equal(statefile.read_state_file(storage, PATH)["a"], torch.zeros(2))


# ---------------------------------------------------------------------------------------------- bad input


def _damaged(tmp_path):
    state = {"a": torch.randn(256), "b": torch.randn(4, 4)}
    _write(tmp_path, state)
    return LocalStorage(tmp_path), str(tmp_path / PATH) + ".tensors"


def test_missing_tensor_file_names_the_file(tmp_path):
    storage, tensors_dir = _damaged(tmp_path)
    os.unlink(os.path.join(tensors_dir, "tensor_1.pt"))
    with pytest.raises(FormatError, match=r"tensor_1\.pt is missing"):
        statefile.read_state_file(storage, PATH)


def test_truncated_tensor_file_names_the_file(tmp_path):
    storage, tensors_dir = _damaged(tmp_path)
    target = os.path.join(tensors_dir, "tensor_0.pt")
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    with pytest.raises(FormatError, match=r"tensor_0\.pt is truncated"):
        statefile.read_state_file(storage, PATH)


def test_reference_to_a_tensor_that_is_not_there(tmp_path):
    storage, _ = _damaged(tmp_path)
    with storage.open_write(PATH) as f:
        xser.save_ref({"a": xser.TensorReference(0), "ghost": xser.TensorReference(7)}, f)
    with pytest.raises(FormatError, match=r"tensor_7\.pt|tensor 7"):
        statefile.read_state_file(storage, PATH)


@pytest.mark.parametrize("field, value", [("shape", torch.Size([255])), ("dtype", torch.float16)])
def test_info_disagreeing_with_a_tensor(tmp_path, field, value):
    storage, _ = _damaged(tmp_path)
    info_path = f"{PATH}.info.pt"
    with storage.open_read(info_path) as f:
        info = torch.load(f, weights_only=True)
    info[0][field] = value
    with storage.open_write(info_path) as f:
        torch.save(info, f)
    with pytest.raises(FormatError, match=r"tensor_0\.pt holds a torch.float32 tensor of shape \(256,\)"):
        statefile.read_state_file(storage, PATH)


def test_tensor_file_that_is_not_a_torch_save_file(tmp_path):
    with pytest.raises(FormatError, match="bogus"):
        xser.load_tensor(io.BytesIO(b"not a zip file at all" * 10), what="bogus")


def test_small_tensors_stay_in_the_reference_file(tmp_path, monkeypatch):
    """By default tensors under 64 KiB are kept inline, as torch_xla keeps CPU tensors; big ones get files."""
    monkeypatch.delenv("NXD_CKPT_XSER_INLINE_BYTES")
    big, small = torch.randn(128, 256), torch.arange(10.0)
    state = {"big": big, "small": small, "small_again": small, "step": torch.tensor(3.0), "view": big[0]}
    written = _write(tmp_path, state)
    storage = LocalStorage(tmp_path)
    assert sorted(p.rsplit("/", 1)[-1] for p in written.paths if ".tensors/" in p) == ["tensor_0.pt"]
    assert written.nbytes == big.numel() * 4 + (10 + 1 + 256) * 4
    info = torch.load(str(tmp_path / PATH) + ".info.pt", weights_only=True)
    assert list(info) == [0]
    loaded = statefile.read_state_file(storage, PATH)
    assert_state_equal(state, loaded)
    assert loaded["small"] is loaded["small_again"]
    assert loaded["view"].untyped_storage().nbytes() == 256 * 4  # inline views are compacted too


def test_each_replica_plans_only_its_own_xser_share(monkeypatch):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", str(64 << 10))
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(256, 64 * (i + 1), generator=g) for i in range(5)} | {"step": torch.tensor(1.0)}
    shares = [
        set(map(id, statefile.tensors_to_write(state, xser_encoding=True, replicas=(0, 1), rank=r))) for r in (0, 1)
    ]
    files = [t for t in state.values() if t.numel() * 4 >= statefile.inline_below_bytes()]
    assert shares[0] & shares[1] == {id(state["step"])}  # only the inline tensor (in the reference data) is shared
    assert {id(t) for t in files} <= shares[0] | shares[1]
    plain = statefile.tensors_to_write(state, xser_encoding=False)
    assert [id(t) for t in plain] == [id(t) for t in state.values()]


def test_a_reference_is_matched_by_torch_xlas_pickled_name_as_nxd_matches_it():
    """NxD selects references with ``isinstance(v, xser.TensorReference)`` (torch_xla's class): the stand-in and any
    class pickled under that name and module count, a class of another module that is named so does not."""
    assert xser.is_reference(xser.TensorReference(3))
    assert xser.is_reference(xser.reference_class()(3))
    lookalike = type("TensorReference", (), {"__module__": "somewhere.else", "tid": 3})()
    assert not xser.is_reference(lookalike)
    assert not xser.is_reference(torch.ones(1)) and not xser.is_reference({"tid": 3})


def test_tensor_meta_reads_no_tensor_file_when_the_info_file_says():
    """dtype and shape of a leaf: a tensor's own, the info file's record, and only without one the tensor file."""
    read: list[int] = []

    def tensor_of(tid: int) -> torch.Tensor:
        read.append(tid)
        return torch.empty(5, 6, dtype=torch.float16, device="meta")

    info = xser.make_info([torch.zeros(2, 3, dtype=torch.bfloat16)])
    assert xser.tensor_meta(torch.zeros(4, dtype=torch.int64), info, tensor_of) == (torch.int64, (4,))
    assert xser.tensor_meta(xser.TensorReference(0), info, tensor_of) == (torch.bfloat16, (2, 3))
    assert read == []
    assert xser.tensor_meta(xser.TensorReference(1), info, tensor_of) == (torch.float16, (5, 6))
    assert xser.tensor_meta(xser.TensorReference(0), None, tensor_of) == (torch.float16, (5, 6))
    assert read == [1, 0]
