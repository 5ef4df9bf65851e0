"""``nxd_ckpt.torchtitan.hf`` in one process: the files a Hugging Face last step is planned into (TorchTitan's
numbering and order, which rank writes which), and the checks of a folder before a load: a gap, an overlap or
bytes after the last tensor in a shard, an index naming the wrong file, a dtype that does not cast, a missing tensor.
The managers' saves and loads end to end: tests/distributed/test_torchtitan_hf.py."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]')")

from safetensors.torch import save_file

from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.torchtitan.hf import Expected, check_hf_folder, expected_of, plan_files

pytestmark = pytest.mark.device_independent


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "c": torch.zeros(5), "d": torch.ones(1)}


def test_one_file_without_a_mapping_in_state_dict_order():
    (only,) = plan_files(_state(), None, world=4)
    assert only.name == "model-00001-of-00001.safetensors" and only.rank == 0
    assert [e.name for e in only.entries] == ["a", "b", "c", "d"]
    assert only.entries[1].dtype == torch.bfloat16 and only.entries[0].shape == (2, 3)


def test_files_numbered_by_the_mapping_in_its_order_and_split_over_ranks():
    mapping = {"d": 3, "c": 1, "x": 2, "a": 1, "b": 3}  # "x": in the index, not in the model (skipped)
    files = plan_files(_state(), mapping, world=2)
    assert [(f.name, [e.name for e in f.entries], f.rank) for f in files] == [
        ("model-00001-of-00003.safetensors", ["c", "a"], 1),
        ("model-00003-of-00003.safetensors", ["d", "b"], 1),
    ]


def test_what_safetensors_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"last_save_in_hf: a \(of 1\) are not in the weight_map of hf_assets_path"):
        plan_files(_state(), {"b": 1, "c": 1, "d": 1}, world=1)
    with pytest.raises(ValueError, match="other values: step"):
        plan_files({**_state(), "step": 3}, None, world=1)


def _folder(tmp_path, tensors: dict[str, torch.Tensor] | None = None) -> str:
    folder = str(tmp_path / "hub")
    os.makedirs(folder)
    save_file(tensors or {"w": torch.ones(2, 2), "v": torch.ones(3)}, os.path.join(folder, "model.safetensors"))
    return folder


def _rewrite_header(path: str, change) -> None:
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        change(header)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        assert len(encoded) <= n
        f.seek(8)
        f.write(encoded + b" " * (n - len(encoded)))


def test_a_valid_folder_passes_and_floats_cast(tmp_path):
    folder = _folder(tmp_path)
    want = {"w": Expected(torch.bfloat16, (2, 2)), "v": Expected(torch.float64, (3,))}
    assert check_hf_folder(folder, want) == [os.path.join(folder, "model.safetensors")]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["w"].update(data_offsets=[h["w"]["data_offsets"][0] - 4, h["w"]["data_offsets"][1] - 4]),
         "w's data overlaps the one before it"),
        (lambda h: h.pop("w"), r"has \d+ bytes but its header describes \d+"),
        (lambda h: h["w"].update(dtype="F64"), r"do not hold its 32 bytes"),
    ],
    ids=["overlap", "trailing-bytes", "wrong-size"],
)  # fmt: skip
def test_a_header_that_does_not_describe_its_file_is_named(tmp_path, change, message):
    folder = _folder(tmp_path)
    path = os.path.join(folder, "model.safetensors")
    _rewrite_header(path, change)
    with pytest.raises(IntegrityError, match=message) as e:
        check_hf_folder(folder, None)
    assert path in str(e.value)


def test_the_index_must_match_the_shards(tmp_path):
    folder = _folder(tmp_path)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"w": "model.safetensors", "v": "model-2.safetensors"}}, f)
    with pytest.raises(IntegrityError, match=r"maps v to .*model-2\.safetensors, but it is in .*model\.safetensors"):
        check_hf_folder(folder, None)


def test_the_model_s_tensors_are_checked(tmp_path):
    folder = _folder(tmp_path, {"w": torch.ones(2, 2), "i": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"model\.safetensors: i is torch\.int64, which does not cast"):
        check_hf_folder(folder, {"i": Expected(torch.float32, (3,))})
    with pytest.raises(ValueError, match="no shard holds missing, which the model needs"):
        check_hf_folder(folder, {"missing": Expected(torch.float32, (3,))})
    assert expected_of({"w": torch.zeros(2, 2), "s": 3}) == {"w": Expected(torch.float32, (2, 2))}


def test_not_a_local_folder_of_safetensors(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        check_hf_folder("s3://bucket/hub", None)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="holds no .safetensors file"):
        check_hf_folder(str(tmp_path / "empty"), None)
