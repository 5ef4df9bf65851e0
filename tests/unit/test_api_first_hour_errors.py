"""The mistakes of a new user's first hour get errors that say what is wrong and what to do."""

from __future__ import annotations

import logging

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointNotFoundError, DeviceUnavailableError, StateMismatchError, StorageError
from nxd_ckpt.testing.fakes import TinyMLP


@pytest.fixture(autouse=True)
def _fresh_manager():
    yield
    nxd.reset_manager()


def test_missing_empty_and_tag_folder_directories_are_told_apart(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint in .*missing \(the directory does not"):
        nxd.load_checkpoint(tmp_path / "missing", model=TinyMLP())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"\(the directory is empty\)"):
        nxd.load_checkpoint(tmp_path / "empty", model=TinyMLP())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="holds no tag folder"):
        nxd.load_checkpoint(tmp_path / "other", model=TinyMLP())

    nxd.save_checkpoint(tmp_path / "ckpt", "step_1", model=TinyMLP())
    with pytest.raises(CheckpointNotFoundError) as info:
        nxd.load_checkpoint(tmp_path / "ckpt" / "step_1", model=TinyMLP())
    message = str(info.value)
    assert "is one checkpoint, a tag folder" in message
    assert f"checkpoint_dir={str(tmp_path / 'ckpt')!r}, tag='step_1'" in message


def test_a_checkpoint_path_under_a_regular_file_is_a_storage_error(tmp_path):
    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory")
    with pytest.raises(StorageError, match=r"somefile/ckpt cannot exist: .*somefile is a regular file"):
        nxd.save_checkpoint(somefile / "ckpt", "step_1", model=TinyMLP())
    with pytest.raises(StorageError, match="is a regular file, not a directory"):
        nxd.load_checkpoint(somefile, model=TinyMLP())
    assert somefile.read_text() == "not a directory"


def test_strict_false_with_no_matching_key_raises_and_a_partial_match_warns(tmp_path, caplog):
    prefixed = {f"module.{k}": v for k, v in TinyMLP().state_dict().items()}  # saved from a DDP wrapper
    nxd.save_checkpoint(tmp_path, "ddp", model=prefixed)
    model = TinyMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"shares no key with the model.*strip 'module\.'"):
        nxd.load_checkpoint(tmp_path, "ddp", model=model, strict=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    partial = {k: v for k, v in TinyMLP().state_dict().items() if k.startswith("fc1.")}
    nxd.save_checkpoint(tmp_path, "fc1_only", model=partial)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        nxd.load_checkpoint(tmp_path, "fc1_only", model=model, strict=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("strict=False: loading 2 of the model's 5 keys" in w and "'fc2.weight'" in w for w in warnings)
    assert torch.equal(model.fc1.weight, partial["fc1.weight"])


def test_optimizer_state_of_other_shapes_fails_at_load_not_in_step(tmp_path):
    small = TinyMLP(d_hidden=16)
    opt = torch.optim.AdamW(small.parameters(), lr=1e-2)
    small(torch.randn(2, 8)).sum().backward()
    opt.step()
    nxd.save_checkpoint(tmp_path, "step_1", optimizer=opt)

    wide = TinyMLP(d_hidden=32)  # same number of parameters, other shapes
    opt2 = torch.optim.AdamW(wide.parameters(), lr=1e-2)
    with pytest.raises(
        StateMismatchError, match=r"does not fit the optimizer's parameters: .*exp_avg: saved \(16, 8\)"
    ):
        nxd.load_checkpoint(tmp_path, "step_1", optimizer=opt2)
    assert opt2.state_dict()["state"] == {}  # nothing was loaded


def test_a_model_on_the_meta_device_is_refused_for_save_and_load(tmp_path):
    nxd.save_checkpoint(tmp_path, "step_1", model=TinyMLP())
    with torch.device("meta"):
        ghost = TinyMLP()
    with pytest.raises(StateMismatchError, match=r"'meta' device .*to_empty\(device='cpu'\)"):
        nxd.load_checkpoint(tmp_path, "step_1", model=ghost)
    with pytest.raises(StateMismatchError, match=r"cannot save the model: \d+ tensor\(s\) are on the 'meta' device"):
        nxd.save_checkpoint(tmp_path, "step_2", model=ghost)
    assert not (tmp_path / "step_2").exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_device_error(tmp_path):
    nxd.save_checkpoint(tmp_path, "step_1", model=TinyMLP())
    with pytest.raises(DeviceUnavailableError, match="asks for CUDA, but this torch .* sees no CUDA device"):
        nxd.load_checkpoint(tmp_path, model={}, device="cuda")


def test_device_for_a_module_target_is_not_silently_ignored(tmp_path):
    nxd.save_checkpoint(tmp_path, "step_1", model=TinyMLP())
    model = TinyMLP()
    with pytest.raises(ValueError, match=r"device='meta' applies to dict targets only; this model lives on cpu"):
        nxd.load_checkpoint(tmp_path, model=model, device="meta")
    nxd.load_checkpoint(tmp_path, model=model, device="cpu")  # where it already lives: fine
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nxd.save_checkpoint(tmp_path, "step_2", optimizer=opt)
    with pytest.raises(ValueError, match="this optimizer lives on cpu"):
        nxd.load_checkpoint(tmp_path, optimizer=opt, device="meta")
