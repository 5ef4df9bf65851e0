"""``nxd_ckpt.torchtitan.hf`` in one process: the files a Hugging Face last step is planned into (TorchTitan's
numbering and order, which rank writes which) and what safetensors cannot hold. The managers' saves and loads end
to end: tests/distributed/test_torchtitan_hf.py; the checks of a folder before a load: tests/tools/test_hf_folder.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "torchtitan.components.checkpointer", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]')"
)

from nxd_ckpt.torchtitan.hf import plan_files

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
