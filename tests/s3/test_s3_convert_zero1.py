"""The offline ZeRO-1 converter with tags on S3 (loopback server): s3 -> s3, values checked by an independent merge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nxd_ckpt import statefile
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.storage.s3 import S3Storage
from nxd_ckpt.tools.convert_zero1 import convert_zero1

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("xser_file_per_tensor")]

SHAPES = {0: (10, 3), 1: (7,), 2: (5, 2)}


def _shard(full: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    if full.size(0) % dp:
        full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, dp - full.size(0) % dp])
    return full.chunk(dp)[rank].clone()


def _full_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "param_groups": [{"lr": 0.1, "params": list(SHAPES)}],
        "base_state": {
            i: {
                "step": torch.tensor(3.0),
                "exp_avg": torch.randn(s, generator=g),
                "exp_avg_sq": torch.rand(s, generator=g),
            }
            for i, s in SHAPES.items()
        },
        "shape_info": {i: torch.Size(s) for i, s in SHAPES.items()},
    }


def _shard_state(full: dict, dp: int, rank: int) -> dict:
    out = dict(full)
    out["base_state"] = {
        i: {k: v.clone() if k == "step" else _shard(v, dp, rank) for k, v in per.items()}
        for i, per in full["base_state"].items()
    }
    return out


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_convert_sharded_to_sharded_and_full_on_s3(s3_url, use_xser):
    storage = S3Storage(s3_url)
    full = _full_state()
    storage.write_bytes("step_3/checkpoint", b"1")
    statefile.write_state_file(storage, layout.model_file("step_3", 0, 0), {"w": torch.ones(2)}, xser_encoding=use_xser)
    for d in range(2):
        path = layout.optim_file("step_3", d, 0, 0)
        statefile.write_state_file(storage, path, _shard_state(full, 2, d), xser_encoding=use_xser)
    storage.write_bytes("step_3/done", b"1")

    report = convert_zero1(f"{s3_url}/step_3", f"{s3_url}/step_3_dp3", dp_size=3)
    assert (report.src_dp, report.dst_dp, report.xser) == (2, 3, use_xser)
    assert storage.exists("step_3_dp3/done")
    assert storage.list_dir("step_3_dp3/model")[0] == "dp_rank_00_tp_rank_00_pp_rank_00.pt"  # carried over
    shards = [statefile.read_state_file(storage, layout.optim_file("step_3_dp3", d, 0, 0)) for d in range(3)]
    for i, shape in SHAPES.items():
        for key in ("exp_avg", "exp_avg_sq"):
            merged = torch.cat([s["base_state"][i][key] for s in shards])[: shape[0]]
            assert torch.equal(merged, full["base_state"][i][key]), (i, key)

    convert_zero1(f"{s3_url}/step_3_dp3", f"{s3_url}/step_3_full", convert_to_full=True)
    merged = statefile.read_state_file(storage, layout.full_optim_file("step_3_full", 0, 0))
    for i in SHAPES:
        assert torch.equal(merged["base_state"][i]["exp_avg"], full["base_state"][i]["exp_avg"])

    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        convert_zero1(f"{s3_url}/step_3", f"{s3_url}/step_3_dp3", dp_size=3)
