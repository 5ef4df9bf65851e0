"""``nxd-ckpt export`` of an optimum-neuron output directory at TP=2 (written here in NxD's layout, as NxD's own
save leaves it): the tensors optimum-neuron's consolidation writes, by its rule (each TP shard of a fused linear
split into its linears, then each linear's shards concatenated along the partition dim); the real consolidation
is compared at TP=1 in tests/thirdparty/test_optimum_real.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nxd_ckpt import cli, statefile
from nxd_ckpt.format import layout
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.tools.optimum_layout import ExportNotSupportedError

TAG = layout.OPTIMUM_SHARDS_TAG
H, INTER = 4, 6  # hidden size, intermediate size (gate and up: 3 rows per TP rank each)


def _write(root: str, specs: list) -> dict[str, torch.Tensor]:
    """TP=2 model files of a tiny MLP block with optimum-neuron's fused ``gate_up_proj``; returns the weights
    the consolidation must produce."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(INTER, H, generator=g), torch.randn(INTER, H, generator=g)
    down, norm = torch.randn(H, INTER, generator=g), torch.randn(H, generator=g)
    storage = LocalStorage(root)
    storage.write_bytes(layout.tag_path(TAG, layout.CHECKPOINT_MARKER), b"1")
    for tp in range(2):
        rows = slice(tp * INTER // 2, (tp + 1) * INTER // 2)
        local = {
            "mlp.gate_up_proj.weight": torch.cat([gate[rows], up[rows]]),
            "mlp.down_proj.weight": down[:, rows].clone(),
            "norm.weight": norm.clone(),
            "rotary.inv_freq": torch.ones(2),  # a buffer: not among the parameters, not consolidated
        }
        statefile.write_state_file(storage, layout.model_file(TAG, tp, 0), local, xser_encoding=True)
    meta = {
        "parameters": {
            "mlp.gate_up_proj.weight": {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1},
            "mlp.down_proj.weight": {"tensor_model_parallel": True, "partition_dim": 1, "partition_stride": 1},
            "norm.weight": {"tensor_model_parallel": False},
        },
        "model_weight_transformation_specs": [{"module_fully_qualified_name": "mlp", "specs": specs}],
    }
    storage.write_bytes(layout.optimum_metadata_file(TAG, 0), json.dumps(meta).encode())
    storage.write_bytes(layout.tag_path(TAG, layout.DONE_MARKER), b"1")
    return {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": down, "norm.weight": norm}


FUSED = {
    "fused_linear_name": "gate_up_proj",
    "linear_names": ["gate_proj", "up_proj"],
    "bias": False,
    "fuse_axis": 0,
    "original_dims": [INTER, INTER],
    "tp_size": 2,
    "peft_type": None,
}


def test_export_unfuses_and_merges_like_the_consolidation(tmp_path, capsys):
    expected = _write(str(tmp_path / "checkpoint-5"), [["FusedLinearsSpec", FUSED]])
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["export", str(tmp_path / "checkpoint-5"), "--out", out, "--no-progress"]) == 0
    got = load_file(out)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert "rotary.inv_freq" in capsys.readouterr().err  # reported as left out


@pytest.mark.parametrize(
    "spec",
    [["GQAQKVColumnParallelLinearSpec", {}], ["FusedLinearsSpec", {**FUSED, "peft_type": "lora"}]],
    ids=["gqa-qkv", "lora"],
)
def test_specs_it_does_not_reproduce_are_refused_with_the_remedy(tmp_path, capsys, spec):
    _write(str(tmp_path / "c"), [spec])
    assert cli.main(["export", str(tmp_path / "c"), "--out", str(tmp_path / "x.safetensors"), "--no-progress"]) != 0
    assert "optimum-cli neuron consolidate" in capsys.readouterr().err
    with pytest.raises(ExportNotSupportedError):
        from nxd_ckpt.inspection import Checkpoint
        from nxd_ckpt.tools.export import export

        export(Checkpoint(LocalStorage(str(tmp_path / "c")), TAG), str(tmp_path / "y.safetensors"))
