"""``nxd_ckpt.tools.hf_folder``: a Hugging Face folder checked before a load: a valid one passes (floating point
dtypes cast), and a gap, an overlap or bytes after the last tensor in a shard, a wrong byte count, an index naming
the wrong file, a dtype that does not cast and a missing tensor are each named. Truncated and past-the-end shards,
wrong shapes and manifests, through the TorchTitan manager: tests/distributed/test_torchtitan_hf.py."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.tools.hf_folder import Expected, check_folder, expected_of, survey_folder

pytestmark = pytest.mark.device_independent


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
    assert check_folder(folder, want) == [os.path.join(folder, "model.safetensors")]


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
        check_folder(folder, None)
    assert path in str(e.value)


def _write_index(folder: str, weight_map: dict[str, str]) -> str:
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


def test_the_index_must_match_the_shards(tmp_path):
    folder = _folder(tmp_path)
    _write_index(folder, {"w": "model.safetensors", "v": "model-2.safetensors"})
    with pytest.raises(IntegrityError, match=r"model-2\.safetensors is missing \(.*index\.json maps tensors to it\)"):
        check_folder(folder, None)
    save_file({"u": torch.ones(1)}, os.path.join(folder, "model-2.safetensors"))
    _write_index(folder, {"w": "model.safetensors", "v": "model-2.safetensors", "u": "model-2.safetensors"})
    with pytest.raises(IntegrityError, match=r"maps v to model-2\.safetensors, but it is in model\.safetensors"):
        check_folder(folder, None)
    _write_index(folder, {"w": "model.safetensors", "v": "../model.safetensors"})
    with pytest.raises(IntegrityError, match=r"maps v to '\.\./model\.safetensors', which is no \.safetensors file"):
        check_folder(folder, None)
    _write_index(folder, {"w": "model.safetensors", "v": "pytorch_model.bin"})
    with pytest.raises(IntegrityError, match=r"maps v to 'pytorch_model\.bin', which is no \.safetensors file"):
        check_folder(folder, None)


def test_a_survey_collects_every_problem_and_a_check_raises_the_first(tmp_path):
    """``nxd-ckpt verify`` reports all that is wrong (``survey_folder``); a load stops at the first problem."""
    folder = _folder(tmp_path)
    save_file({"u": torch.ones(4)}, os.path.join(folder, "model-2.safetensors"))
    save_file({"t": torch.ones(4)}, os.path.join(folder, "stray.safetensors"))
    damaged = os.path.join(folder, "model-2.safetensors")
    os.truncate(damaged, os.path.getsize(damaged) - 1)
    index = _write_index(folder, {"w": "model.safetensors", "v": "model-3.safetensors", "u": "model-2.safetensors"})
    check = survey_folder(folder, {"w": Expected(torch.float32, (4,))})
    assert [type(p) for p in check.problems] == [IntegrityError, IntegrityError, ValueError], check.problems
    assert str(check.problems[0]).startswith(f"{damaged} has an invalid safetensors header")
    assert str(check.problems[1]).startswith(f"{folder}/model-3.safetensors is missing ({index} maps")
    assert "w has shape [2, 2], but the model's is [4]" in str(check.problems[2])
    assert check.notes == [
        f"{folder}/stray.safetensors is not named by model.safetensors.index.json: loaders never open it"
    ]
    assert check.shards == ["model-2.safetensors", "model.safetensors", "stray.safetensors"] and check.index
    assert check.files_checked == 4 and check.manifests == 0 and sorted(check.tensors) == ["t", "v", "w"]
    with pytest.raises(IntegrityError) as e:
        check_folder(folder, None)
    assert str(e.value) == str(check.problems[0])


def test_the_model_s_tensors_are_checked(tmp_path):
    folder = _folder(tmp_path, {"w": torch.ones(2, 2), "i": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"model\.safetensors: i is torch\.int64, which does not cast"):
        check_folder(folder, {"i": Expected(torch.float32, (3,))})
    with pytest.raises(ValueError, match="no shard holds missing, which the model needs"):
        check_folder(folder, {"missing": Expected(torch.float32, (3,))})
    assert expected_of({"w": torch.zeros(2, 2), "s": 3}) == {"w": Expected(torch.float32, (2, 2))}


def test_not_a_local_folder_of_safetensors(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        check_folder("s3://bucket/hub", None)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="holds no .safetensors file"):
        check_folder(str(tmp_path / "empty"), None)


def test_manifests_under_a_name_the_library_never_writes_are_a_note(tmp_path):
    """Only a folder the library can have written (a valid tag name) is checked against ``nxd_ckpt/``; another
    one says why its manifests were not read, and still gets every other check."""
    folder = tmp_path / "my model"
    os.makedirs(folder / "nxd_ckpt")
    save_file({"w": torch.ones(2)}, folder / "model.safetensors")
    check = survey_folder(str(folder))
    assert check.problems == [] and check.manifests == 0
    assert check.notes == [f"{folder}/nxd_ckpt was not read: 'my model' is no folder name the library writes"]
    assert check_folder(str(folder), {"w": Expected(torch.float32, (2,))}) == [str(folder / "model.safetensors")]
