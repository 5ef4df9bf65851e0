"""Inspecting a tag written by torch_xla's own ``xser.save`` (as NxD writes it: no info file, no nxd_ckpt files)."""

from __future__ import annotations

import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.cli import main

pytestmark = pytest.mark.xla

torch_xla = pytest.importorskip("torch_xla")
xser = pytest.importorskip("torch_xla.utils.serialization")

STATE_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def test_torch_xla_xser_tag_inspects_and_reads_one_tensor(tmp_path, capsys):
    device = torch_xla.device()  # xser.save references XLA tensors (CPU ones it would store inline)
    state = {"a": torch.randn(4, 3).to(device), "nested": {"b": torch.arange(5).to(device), "scale": 0.5}}
    tag = tmp_path / "step_1"
    os.makedirs(tag / "model")
    (tag / "checkpoint").write_bytes(b"1")
    xser.save(state, str(tag / "model" / STATE_FILE))
    (tag / "done").write_bytes(b"1")

    ckpt = nxd.open_checkpoint(tmp_path)
    assert ckpt.layout().xser and ckpt.metadata is None
    objects = {o.path: o for o in ckpt.objects()}
    assert (objects["model/tp00_pp00/a"].dtype, objects["model/tp00_pp00/a"].shape) == ("float32", (4, 3))
    assert objects["model/tp00_pp00/nested/scale"].value == 0.5
    tensors_dir = tag / "model" / (STATE_FILE + ".tensors")
    wanted = objects["model/tp00_pp00/nested/b"].file.rsplit("/", 1)[1]
    for f in tensors_dir.iterdir():
        if f.name != wanted:
            f.unlink()
    assert torch.equal(nxd.open_checkpoint(tmp_path).read("model/tp00_pp00/nested/b"), torch.arange(5))
    assert main(["verify", str(tmp_path), "--quick"]) == 1
    assert "tensor_" in capsys.readouterr().err
