"""nxd_ckpt.dcp.Stager in one process (``no_dist``) with CPU state: ``dcp.async_save`` stages into reused host
buffers, training changes after the call never reach the checkpoint, one stager serves consecutive saves (DCP's
DefaultStager failed on the second on torch 2.11), the host memory budget holds, and errors reach the caller."""

from __future__ import annotations

import gc
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nxd_ckpt.dcp import Stager, StorageWriter
from nxd_ckpt.errors import CheckpointError, CheckpointTimeoutError

pytestmark = pytest.mark.device_independent  # CPU state: runs once, in the CPU lane


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        yield


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "tied": w, "b": torch.randn(32, generator=g).half(), "view": w[:, 3:9]},
        "train_state": {"step": 0, "seen": [1, 2]},
    }


def _expected(state: dict) -> dict:
    model = state["model"]
    return {
        "model": {k: v.clone() for k, v in model.items()},
        "train_state": {"step": state["train_state"]["step"], "seen": list(state["train_state"]["seen"])},
    }


def _train(state: dict) -> None:
    """What a training step does to the live state: tensors and mutable leaves change in place."""
    with torch.no_grad():
        state["model"]["w"].mul_(1.5).add_(1.0)
        state["model"]["b"].add_(2.0)
    state["train_state"]["step"] += 1
    state["train_state"]["seen"].append(state["train_state"]["step"])


def _load_stock(path: str) -> dict:
    out = {
        "model": {"w": torch.zeros(64, 32), "tied": torch.zeros(64, 32), "b": torch.zeros(32).half(),
                  "view": torch.zeros(64, 6)},
        "train_state": {"step": -1, "seen": []},
    }  # fmt: skip
    dcp.load(out, storage_reader=dcp.FileSystemReader(path))
    return out


def _assert_same(got: dict, want: dict) -> None:
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert got["train_state"] == want["train_state"]


def _wait_released(stager: Stager, timeout_s: float = 30.0) -> None:
    """Until the staged copies are back in the pool: DCP's upload thread drops the staged state dict a moment after
    ``upload_completion`` resolves (on a busy machine, after the test's next line)."""
    deadline = time.monotonic() + timeout_s
    while stager._leases:
        assert time.monotonic() < deadline, f"the staged copies were not given back within {timeout_s} s"
        gc.collect()
        time.sleep(0.01)


def test_three_async_saves_through_one_stager_keep_what_was_staged(tmp_path):
    """A training step right after each async_save returns changes nothing saved; stock DCP loads each bit-exactly;
    the second and third saves copy into the first's buffers (nothing allocated)."""
    state, stager = _state(), Stager()
    allocated = []
    for n in range(3):
        want = _expected(state)
        response = dcp.async_save(state, storage_writer=StorageWriter(tmp_path / f"step-{n}"), async_stager=stager)
        allocated.append(stager.last_allocated_bytes)
        _train(state)
        response.upload_completion.result(timeout=60)
        assert response.staging_completion.done()
        _assert_same(_load_stock(str(tmp_path / f"step-{n}")), want)
        _wait_released(stager)
    assert allocated[0] > 0 and allocated[1:] == [0, 0], allocated
    stager.close()


def test_staged_copies_go_back_to_the_pool_when_the_upload_drops_them():
    """Staging lends the pool's buffers; they come back once nobody holds the staged state dict."""
    stager = Stager()
    staged = stager.stage(_state()).result()
    assert len(stager._leases) == 1 and stager.pool.held_bytes == 0
    del staged
    gc.collect()
    assert not stager._leases and stager.pool.held_bytes > 0


def test_a_budget_for_one_save_makes_the_next_wait_for_the_first_copies():
    """host_memory_budget holds the copies of one save: a second stage waits (here past its deadline) while the
    first's staged state dict is alive, and goes through once it is dropped."""
    state = _state()
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in state["model"].values()}.values())
    stager = Stager(host_memory_budget=size + size // 2, timeout=0.3)
    first = stager.stage(state).result()
    with pytest.raises(CheckpointTimeoutError, match=r"staging an async DCP save on rank 0: waited 0.3 s .* held"):
        stager.stage(state)
    del first
    second = stager.stage(state).result()
    assert torch.equal(second["model"]["w"], state["model"]["w"])


def test_a_state_larger_than_the_budget_is_refused():
    with pytest.raises(CheckpointError, match="more than host_memory_budget=1024"):
        Stager(host_memory_budget=1024).stage(_state())


def test_an_error_after_the_future_settled_reaches_the_next_call(monkeypatch):
    """Giving the copies back fails (after DCP got the state dict): the next stage raises it, naming the cause."""
    from nxd_ckpt.save.staging import StagedState

    stager = Stager()

    def broken_release(self) -> None:
        raise OSError("injected: the pool could not take the buffers back")

    monkeypatch.setattr(StagedState, "release", broken_release)
    staged = stager.stage(_state()).result()
    del staged
    gc.collect()
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="injected: the pool could not take"):
        stager.stage(_state())
    assert stager.stage(_state()).result()["train_state"]["step"] == 0  # reported once; the stager goes on


def test_a_closed_stager_refuses_to_stage():
    stager = Stager()
    stager.close()
    with pytest.raises(CheckpointError, match="was closed"):
        stager.stage(_state())
