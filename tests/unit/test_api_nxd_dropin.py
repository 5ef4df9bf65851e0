"""NxD's public API as NxD spells it: signatures, keyword names, num_kept_ckpts=-1, unmarked tags, DCP refusal.

Expected names and order are NxD release 2.29's (``neuronx_distributed/trainer/checkpoint.py``), written out here.
"""

from __future__ import annotations

import inspect
import logging
import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointNotFoundError, FormatError
from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal

NXD_SAVE = [
    "checkpoint_dir_str",
    "tag",
    "model",
    "optimizer",
    "scheduler",
    "user_content",
    "num_workers",
    "use_xser",
    "num_kept_ckpts",
    "async_save",
    "zero1_optimizer",
    "use_zero1_dcp",
    "avoid_saving_lower_precision_weights",
]
NXD_LOAD = ["path", "tag", "model", "optimizer", "scheduler", "num_workers", "strict", "use_zero1_dcp"]
NXD_DEFAULTS = {
    "model": None,
    "optimizer": None,
    "scheduler": None,
    "user_content": None,
    "num_workers": 8,
    "use_xser": False,
    "num_kept_ckpts": None,
    "async_save": False,
    "zero1_optimizer": False,
    "use_zero1_dcp": False,
    "avoid_saving_lower_precision_weights": False,
    "tag": None,
    "strict": True,
}


@pytest.mark.parametrize(
    ("fn", "names"),
    [
        (nxd.save_checkpoint, NXD_SAVE),
        (nxd.load_checkpoint, NXD_LOAD),
        (nxd.has_checkpoint, ["checkpoint_dir_str"]),
        (nxd.finalize_checkpoint, []),
    ],
)
def test_signatures_are_nxds_with_extras_keyword_only(fn, names):
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == names
    assert params[: len(names)] == positional  # NxD's come first, in NxD's order
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(names) :])
    for p in positional:
        if p.name in NXD_DEFAULTS and not (fn is nxd.save_checkpoint and p.name == "tag"):
            assert p.default == NXD_DEFAULTS[p.name], p.name


def test_nxd_keyword_names_work(tmp_path, caplog):
    model = TinyMLP()
    nxd.save_checkpoint(
        checkpoint_dir_str=str(tmp_path),
        tag="s1",
        model=model,
        num_workers=8,
        use_xser=False,
        num_kept_ckpts=-1,
        async_save=False,
        zero1_optimizer=False,
        use_zero1_dcp=False,
        avoid_saving_lower_precision_weights=True,
    )
    assert nxd.has_checkpoint(checkpoint_dir_str=str(tmp_path))
    m2 = TinyMLP(d_in=8)
    nxd.load_checkpoint(path=str(tmp_path), tag="s1", model=m2, num_workers=8, strict=True, use_zero1_dcp=True)
    assert_state_equal(model.state_dict(), m2.state_dict())
    nxd.finalize_checkpoint()


def test_use_zero1_dcp_writes_nxd_files_with_a_warning_and_cannot_combine(tmp_path, caplog):
    opt_state = {"base_state": {0: {"exp_avg": torch.ones(2)}}, "shape_info": {0: [2]}, "param_groups": []}
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        nxd.save_checkpoint(str(tmp_path), "s1", optimizer=opt_state, zero1_optimizer=True, use_zero1_dcp=True)
    assert os.path.exists(tmp_path / "s1" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    with pytest.raises(ValueError, match="cannot be combined"):
        nxd.save_checkpoint(
            str(tmp_path), "s2", model=TinyMLP(), use_zero1_dcp=True, avoid_saving_lower_precision_weights=True
        )


def test_num_kept_ckpts_minus_one_keeps_all(tmp_path):
    model = TinyMLP()
    for step in range(1, 5):
        nxd.save_checkpoint(str(tmp_path), f"step_{step}", model=model, num_kept_ckpts=-1)
    assert nxd.list_checkpoint_tags(tmp_path) == ["step_1", "step_2", "step_3", "step_4"]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_kept_ckpts"):
            nxd.save_checkpoint(str(tmp_path), "step_9", model=model, num_kept_ckpts=bad)


def _pretrained_weight(root, model: torch.nn.Module) -> None:
    """What NxD's checkpoint_converter.py writes: model files, no checkpoint/done markers."""
    os.makedirs(root / "pretrained_weight" / "model")
    torch.save(model.state_dict(), root / "pretrained_weight" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")


def test_unmarked_pretrained_weight_tag_loads_with_a_warning(tmp_path, caplog):
    model = TinyMLP()
    _pretrained_weight(tmp_path, model)
    m2 = TinyMLP()
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        assert nxd.load_checkpoint(str(tmp_path), tag="pretrained_weight", model=m2) is None
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert any("completeness cannot be checked" in r.getMessage() for r in caplog.records)
    # "latest" still considers complete tags only
    assert not nxd.has_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        nxd.load_checkpoint(str(tmp_path), model=TinyMLP())
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model)
    assert nxd.latest_checkpoint_tag(str(tmp_path)) == "step_1"
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["step_1"]


def test_interrupted_and_empty_tags_are_still_refused(tmp_path):
    model = TinyMLP()
    _pretrained_weight(tmp_path, model)
    (tmp_path / "pretrained_weight" / "checkpoint").write_text("1")  # a save began here and never finished
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        nxd.load_checkpoint(str(tmp_path), tag="pretrained_weight", model=TinyMLP())
    os.makedirs(tmp_path / "empty" / "model")
    with pytest.raises(CheckpointNotFoundError):
        nxd.load_checkpoint(str(tmp_path), tag="empty", model=TinyMLP())


def test_dcp_optimizer_state_is_refused_clearly(tmp_path):
    model = TinyMLP()
    nxd.save_checkpoint(str(tmp_path), "s1", model=model)
    os.makedirs(tmp_path / "s1" / "optim")
    (tmp_path / "s1" / "optim" / ".metadata").write_bytes(b"dcp")
    with pytest.raises(FormatError, match="Distributed Checkpoint"):
        nxd.load_checkpoint(str(tmp_path), "s1", model=TinyMLP(), optimizer={}, verify=False)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_xser_info_marks_expert_parameters_like_nxd(tmp_path, async_save, monkeypatch):
    """NxD records ``expert_model_parallel`` per tensor in the xser info file; the mark lives on parameters and
    must survive ``state_dict()`` (detached tensors) and async staging (host copies in reused buffers)."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.expert_model_parallel = True
    for step in (1, 2):  # the second async save reuses the first one's host buffers
        report = nxd.save_checkpoint(str(tmp_path), f"s{step}", model=model, use_xser=True, async_save=async_save)
        report.wait()
        path = tmp_path / f"s{step}" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
        info = torch.load(str(path) + ".info.pt")
        flags = {tuple(v["shape"]): v["expert_model_parallel"] for v in info.values()}
        assert flags == {(4, 4): False, (4,): False, (2, 4): True, (2,): False}
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    nxd.load_checkpoint(str(tmp_path), model=m2)
    assert_state_equal(model.state_dict(), m2.state_dict())
