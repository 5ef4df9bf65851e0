"""Inspection and the nxd-ckpt command line on ``s3://`` checkpoints (loopback S3 server)."""

from __future__ import annotations

import json

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.cli import main
from nxd_ckpt.testing.fakes import make_training, train_steps

pytestmark = pytest.mark.s3


def test_inspect_read_and_cli_on_s3(s3_url, capsys):
    model, opt, sched = make_training(seed=5, device="cpu")
    train_steps(model, opt, sched, 2, seed=5)
    nxd.save_checkpoint(s3_url, "plain", model=model, optimizer=opt, scheduler=sched)
    nxd.save_checkpoint(s3_url, "xser", model=model, optimizer=opt, use_xser=True)
    for tag in ("plain", "xser"):
        ckpt = nxd.open_checkpoint(s3_url, tag)
        shapes = {o.path: o.shape for o in ckpt.objects("model/tp00_pp00")}
        assert shapes["model/tp00_pp00/fc1.weight"] == (16, 8)
        assert torch.equal(ckpt.read("model/tp00_pp00/fc1.weight"), model.state_dict()["fc1.weight"])
        assert torch.equal(ckpt.read("optim/dp00_tp00_pp00/state/1/exp_avg"), opt.state_dict()["state"][1]["exp_avg"])

    assert main(["list", s3_url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(t["tag"], t["latest"]) for t in listing["tags"]] == [("plain", False), ("xser", True)]
    assert main(["inspect", s3_url, "--tag", "plain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["tensors"] == 17
    assert main(["verify", s3_url, "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[:2] for line in lines] == [["plain", " OK"], ["xser", " OK"]]


def test_cli_on_one_dcp_folder_and_an_hf_folder_on_s3(s3_url, capsys, tmp_path):
    """``verify``/``list`` take an ``s3://`` DCP folder itself; an HF folder on S3 is refused with the way to
    check it (its headers are read from local files)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import nxd_ckpt.dcp
    from nxd_ckpt.storage import storage_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(8, 4)}, storage_writer=nxd_ckpt.dcp.StorageWriter(f"{s3_url}/step-2"))
    assert main(["verify", f"{s3_url}/step-2"]) == 0
    assert capsys.readouterr().out.startswith("step-2: OK: 2 files checked by checksums from 1 manifests")
    assert main(["list", f"{s3_url}/step-2", "--json"]) == 0
    assert [t["tag"] for t in json.loads(capsys.readouterr().out)["tags"]] == ["step-2"]
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    storage_for(s3_url).write_bytes("hf/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    assert main(["verify", f"{s3_url}/hf"]) == 1
    assert f"copy it first (e.g. aws s3 sync {s3_url}/hf DIR)" in capsys.readouterr().err
