"""Step 6 of a load: a resume of a tag saved with ``async_save=True`` prepares the next async save
(``prepare_async_save`` of the model and optimizer it restored), so the first async save after the resume does
not pay the one-time costs in its call. On CPU state that is the staging buffers (reserved and faulted in by
the load: the first save allocates nothing); the XLA lane checks the device snapshot's compile
(tests/xla/test_xla_device_snapshot.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nxd_ckpt.format.metadata import read_metadata
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps


def _saved(tmp_path, **keywords) -> str:
    """A tag of a trained CPU model and optimizer, saved by a manager that is then dropped (a finished job)."""
    model, opt, sched = make_training(seed=3, device="cpu")
    train_steps(model, opt, sched, 2, seed=1)
    writer = CheckpointManager()
    writer.save(str(tmp_path), "step_2", model=model, optimizer=opt, **keywords)
    writer.finalize()
    return "step_2"


def _resume_then_save(tmp_path, **load_keywords) -> tuple[int, int]:
    """A new process's manager: load, one step, one async save. Returns (bytes the load reserved for staging,
    bytes the first async save allocated)."""
    manager = CheckpointManager()
    model, opt, sched = make_training(seed=9, device="cpu")
    keywords = {"model": model, "optimizer": opt} | load_keywords
    manager.load(str(tmp_path), **keywords)
    assert manager._staging_pool.wait_prepared(30)
    reserved = manager._staging_pool.held_bytes  # what the load left for the first save
    train_steps(model, opt, sched, 1, seed=2)
    report = manager.save(str(tmp_path), "step_3", model=model, optimizer=opt, async_save=True)
    manager.finalize()
    return reserved, report.staging_allocated_bytes


def test_the_save_records_whether_it_was_asynchronous(tmp_path):
    _saved(tmp_path / "a", async_save=True)
    _saved(tmp_path / "s")
    assert read_metadata(LocalStorage(str(tmp_path / "a")), "step_2").saved_async is True
    assert read_metadata(LocalStorage(str(tmp_path / "s")), "step_2").saved_async is False


def test_a_resume_of_an_async_saved_tag_reserves_the_first_saves_buffers(tmp_path):
    _saved(tmp_path, async_save=True)
    reserved, allocated = _resume_then_save(tmp_path)
    assert reserved > 0 and allocated == 0


def test_control_a_resume_of_a_synchronously_saved_tag_reserves_nothing(tmp_path):
    _saved(tmp_path)
    reserved, allocated = _resume_then_save(tmp_path)
    assert reserved == 0 and allocated > 0


def test_control_prepare_on_resume_off(tmp_path, monkeypatch):
    _saved(tmp_path, async_save=True)
    monkeypatch.setenv("NXD_CKPT_PREPARE_ON_RESUME", "0")
    reserved, allocated = _resume_then_save(tmp_path)
    assert reserved == 0 and allocated > 0


def test_under_a_host_memory_budget_no_host_buffers_are_reserved(tmp_path, monkeypatch):
    """Saves under a budget stage in pieces: a whole copy reserved at the resume would break the budget."""
    _saved(tmp_path, async_save=True)
    monkeypatch.setenv("NXD_CKPT_HOST_MEMORY_BUDGET", "64KiB")
    reserved, _ = _resume_then_save(tmp_path)
    assert reserved == 0


def test_a_tag_from_before_the_record_is_not_taken_for_an_async_one(tmp_path):
    _saved(tmp_path, async_save=True)
    storage = LocalStorage(str(tmp_path))
    old = read_metadata(storage, "step_2").to_dict()
    del old["async_save"]
    (tmp_path / "step_2" / "nxd_ckpt.json").write_text(json.dumps(old))
    reserved, _ = _resume_then_save(tmp_path, verify=False)
    assert reserved == 0


def test_a_resume_of_part_of_what_the_tag_holds_prepares_nothing(tmp_path):
    """The tag holds model and optimizer: a load of the model alone is not what the next save will stage."""
    _saved(tmp_path, async_save=True)
    manager = CheckpointManager()
    model, _, _ = make_training(seed=9, device="cpu")
    manager.load(str(tmp_path), model=model)
    assert manager._staging_pool.held_bytes == 0
    manager.finalize()


def test_a_failed_preparation_is_logged_and_the_loaded_state_stays(tmp_path, monkeypatch, caplog):
    _saved(tmp_path, async_save=True)
    manager = CheckpointManager()

    def broken(*args, **keywords):
        raise RuntimeError("device out of memory")

    monkeypatch.setattr(manager._staging_pool, "prepare", broken)  # where a device out of memory would raise
    model, opt, _ = make_training(seed=9, device="cpu")
    expected, _, _ = make_training(seed=3, device="cpu")
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        manager.load(str(tmp_path), model=model, optimizer=opt)
    assert "preparing the next async save failed (RuntimeError: device out of memory)" in caplog.text
    assert "NXD_CKPT_PREPARE_ON_RESUME=0" in caplog.text
    loaded = CheckpointManager()
    loaded.load(str(tmp_path), model=expected, optimizer=torch.optim.AdamW(expected.parameters()))
    assert_state_equal(model.state_dict(), expected.state_dict())


@pytest.mark.parametrize("items", [("model",), ("optimizer",)])
def test_a_tag_of_one_item_resumed_into_that_item_is_prepared(tmp_path, items):
    model, opt, sched = make_training(seed=3, device="cpu")
    train_steps(model, opt, sched, 1, seed=1)
    writer = CheckpointManager()
    given = {"model": model, "optimizer": opt}
    writer.save(str(tmp_path), "one", async_save=True, **{k: given[k] for k in items})
    writer.finalize()
    manager = CheckpointManager()
    fresh_model, fresh_opt, _ = make_training(seed=9, device="cpu")
    fresh = {"model": fresh_model, "optimizer": fresh_opt}
    if items == ("optimizer",):
        train_steps(fresh_model, fresh_opt, sched, 1, seed=1)  # the optimizer state exists to load into
    manager.load(str(tmp_path), **{k: fresh[k] for k in items})
    assert manager._staging_pool.held_bytes > 0
    manager.finalize()


def _load_pipeline(tmp_path, **keywords):
    """A load pipeline run alone (no manager), over a fresh model and optimizer; the pipeline afterwards."""
    from nxd_ckpt.load.pipeline import LoadPipeline, LoadServices
    from nxd_ckpt.options import load_options
    from nxd_ckpt.ranks.coordinator import Coordinator
    from nxd_ckpt.ranks.topology import Topology

    services = LoadServices(
        coordinator=Coordinator(),
        topology=lambda: Topology(rank=0),
        storage_for=lambda d: LocalStorage(str(d)),
        tier_runtime=lambda *a: pytest.fail("no memory tier in this load"),
        on_restore=lambda report: None,
    )
    model, opt, _ = make_training(seed=9, device="cpu")
    pipeline = LoadPipeline(services)
    pipeline.run(load_options(str(tmp_path), model=model, optimizer=opt, **keywords))
    return pipeline


def test_the_load_reports_an_async_resume_and_prepares_nothing_itself(tmp_path):
    """Step 6 is the manager's: the load pipeline only says which tag it resumed and how it was encoded."""
    from nxd_ckpt.load.pipeline import AsyncResume

    _saved(tmp_path / "a", async_save=True, use_xser=True)
    _saved(tmp_path / "s")
    assert _load_pipeline(tmp_path / "a").resumed == AsyncResume("step_2", use_xser=True)
    assert _load_pipeline(tmp_path / "s").resumed is None
