"""ZeRO-1 files hold NxD's containers (plain dicts, lists), so NxD's converter logic accepts them.

NxD's save path rewrites every tuple (``torch.Size`` too) into a list and every OrderedDict into a dict, and its
converter (``optimizer/convert_zero_checkpoints.py``) asserts ``list(result.shape) == shape`` with ``shape`` from
``shape_info``: True for a list, False for a tuple or ``torch.Size``. ``_nxd_merge`` below makes the same checks
as NxD's converter, on the files nxd_ckpt wrote.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt.tools.convert_zero1 import convert_zero1

SHAPES = {0: (5, 3), 1: (4,)}


def _zero1_state(dp_rank: int, dp: int) -> dict:
    """A ZeRO-1 state as torch_xla's optimizer returns it: torch.Size shapes, tuples, an OrderedDict."""
    g = torch.Generator().manual_seed(7)
    full = {i: torch.randn(s, generator=g) for i, s in SHAPES.items()}

    def shard(t: torch.Tensor) -> torch.Tensor:
        rows = -(-t.size(0) // dp) * dp
        padded = torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - t.size(0)])
        return padded.chunk(dp)[dp_rank].clone()

    return OrderedDict(
        param_groups=[{"params": [0, 1], "lr": 0.1, "betas": (0.9, 0.99)}],
        base_state={i: OrderedDict(step=torch.tensor(2.0), exp_avg=shard(t)) for i, t in full.items()},
        shape_info={i: torch.Size(s) for i, s in SHAPES.items()},
        state={},
    )


def _containers(obj: Any, path: str = "") -> list[str]:
    """Paths of containers NxD would never write (tuples, torch.Size, OrderedDicts, dict subclasses)."""
    bad = []
    if isinstance(obj, dict):
        if type(obj) is not dict:
            bad.append(f"{path or '/'}: {type(obj).__name__}")
        for k, v in obj.items():
            bad += _containers(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Tensor):
        if type(obj) is not list:
            bad.append(f"{path}: {type(obj).__name__}")
        for i, v in enumerate(obj):
            bad += _containers(v, f"{path}/{i}")
    return bad


def _nxd_merge(partials: list[dict]) -> dict:
    """The checks NxD's converter makes when merging DP shards (``merge_optim_dp_checkpoints``)."""

    def merge(values: list[Any], shape: Any) -> Any:
        if isinstance(values[0], torch.Tensor):
            result = torch.cat(values)
            if result.shape != shape:
                result = result[: shape[0]]
            assert list(result.shape) == shape, f"NxD's converter: {list(result.shape)} != {shape!r}"
            return result
        if isinstance(values[0], dict):
            return {k: values[0][k] if k == "step" else merge([v[k] for v in values], shape) for k in values[0]}
        return values[0]

    return {k: merge([p["base_state"][k] for p in partials], s) for k, s in partials[0]["shape_info"].items()}


@run_with_ranks(2)
def test_zero1_files_have_nxd_containers_and_pass_nxd_converter_checks(tmp_path):
    rank = dist.get_rank()
    ckpt = str(tmp_path / "ckpt")
    state = _zero1_state(rank, 2)
    nxd.save_checkpoint(ckpt, "s1", optimizer=state, zero1_optimizer=True)
    assert isinstance(state["shape_info"][0], torch.Size)  # the caller's state is left as it was
    if rank == 0:
        optim = os.path.join(ckpt, "s1", "optim")
        partials = [torch.load(os.path.join(optim, f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt")) for d in (0, 1)]
        for p in partials:
            assert _containers(p) == []
            assert p["shape_info"] == {0: [5, 3], 1: [4]}
            assert p["param_groups"][0]["betas"] == [0.9, 0.99]
        merged = _nxd_merge(partials)
        g = torch.Generator().manual_seed(7)
        for i, s in SHAPES.items():
            assert torch.equal(merged[i]["exp_avg"], torch.randn(s, generator=g))
        # our converter's output has NxD's containers too
        convert_zero1(os.path.join(ckpt, "s1"), os.path.join(ckpt, "full"), convert_to_full=True)
        full = torch.load(os.path.join(ckpt, "full", "optim", "full_tp_rank_00_pp_rank_00.pt"))
        assert _containers(full) == []
        _nxd_merge([full])
    dist.barrier()
    loaded: dict = {}
    nxd.load_checkpoint(ckpt, "s1", optimizer=loaded)
    assert torch.equal(loaded["base_state"][1]["exp_avg"], state["base_state"][1]["exp_avg"])
    assert loaded["shape_info"] == {0: [5, 3], 1: [4]}
