"""Files that others keep in a tag folder survive nxd_ckpt's saves (optimum-neuron writes its consolidation
metadata into ``shards/`` and touches ``shards/done`` before an async save into a new directory)."""

from __future__ import annotations

import os

import torch

import nxd_ckpt as nxd
from nxd_ckpt.format import layout, tags
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

META = "mp_metadata_pp_rank_0.json"


def test_a_bare_done_is_no_checkpoint_the_save_goes_in_place(tmp_path):
    tag = tmp_path / "shards"
    tag.mkdir()
    (tag / "done").touch()  # optimum-neuron's _wait_previous_async_save, before its save
    assert not tags.holds_complete_checkpoint(LocalStorage(str(tmp_path)), "shards")
    state = {"w": torch.arange(6.0)}
    report = nxd.save_checkpoint(str(tmp_path), "shards", model=state, async_save=True)
    (tag / META).write_text("{}")  # written right after the save call returns
    report.wait()
    nxd.finalize_checkpoint()
    assert (tag / META).read_text() == "{}"
    assert nxd.verify(str(tmp_path), "shards").ok
    loaded: dict = {}
    nxd.load_checkpoint(str(tmp_path), "shards", model=loaded)
    assert_state_equal(loaded, state)


def test_a_resave_keeps_the_old_copys_foreign_files(tmp_path):
    nxd.save_checkpoint(str(tmp_path), "shards", model={"w": torch.zeros(3)})
    (tmp_path / "shards" / META).write_text('{"v": "old"}')
    (tmp_path / "shards" / "extra.json").write_text("[1]")
    assert tags.holds_complete_checkpoint(LocalStorage(str(tmp_path)), "shards")
    nxd.save_checkpoint(str(tmp_path), "shards", model={"w": torch.ones(3)})  # a re-save, swapped in
    assert (tmp_path / "shards" / META).read_text() == '{"v": "old"}'
    assert (tmp_path / "shards" / "extra.json").read_text() == "[1]"
    assert not any(n.startswith(layout.RESAVE_PREFIX) for n in os.listdir(tmp_path))
    loaded: dict = {}
    nxd.load_checkpoint(str(tmp_path), "shards", model=loaded)
    assert torch.equal(loaded["w"], torch.ones(3)) and nxd.verify(str(tmp_path), "shards").ok
