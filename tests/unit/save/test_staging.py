"""StagingPool: training-safe host snapshots in buffers reused from one save to the next, bounded, released."""

from __future__ import annotations

import collections
import sys
import time

import pytest
import torch

from nxd_ckpt.device import transfer
from nxd_ckpt.save import staging
from nxd_ckpt.testing.fakes import assert_state_equal


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": weight, "b": torch.randn(32, generator=g), "tied": weight},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32, generator=g)}}},
        "meta": {"lr": 0.1, "names": ["a", "b"]},
    }


def _clone(tree):
    from nxd_ckpt.tree import map_tensors

    return map_tensors(tree, lambda t: t.clone())


def _ptrs(tree) -> list[int]:
    from nxd_ckpt.tree import iter_tensors

    return [t.data_ptr() for _, t in iter_tensors(tree)]


def test_snapshot_is_independent_of_later_in_place_updates():
    state = _state()
    expected = _clone(state)
    pool = staging.StagingPool()
    staged = pool.stage([state["model"], state["optim"], state["meta"]])
    for t in (state["model"]["w"], state["model"]["b"], state["optim"]["state"][0]["exp_avg"]):
        t.add_(1000.0)
    state["optim"]["state"][0]["step"] += 1
    model, optim, meta = staged.trees
    assert_state_equal(model, expected["model"])
    assert_state_equal(optim, expected["optim"])
    assert meta == {"lr": 0.1, "names": ["a", "b"]}
    assert staged.nbytes == sum(t.numel() * t.element_size() for t in (model["w"], model["b"])) + 4 + 64 * 32 * 4


def test_tied_tensors_stay_shared_in_the_snapshot():
    state = _state()
    staged = staging.StagingPool().stage([state["model"]])
    model = staged.trees[0]
    assert model["w"] is model["tied"]
    assert model["w"].data_ptr() != state["model"]["w"].data_ptr()


def test_buffers_are_reused_by_the_next_save_with_the_same_layout():
    pool = staging.StagingPool()
    first = pool.stage([_state(0)])
    assert first.allocated_bytes == first.nbytes > 0
    ptrs = _ptrs(first.trees)
    first.release()
    assert pool.held_bytes == first.nbytes
    state = _state(1)
    second = pool.stage([state])
    assert second.allocated_bytes == 0
    assert _ptrs(second.trees) == ptrs  # the very same memory, refilled
    assert_state_equal(second.trees[0], state)


def test_a_changed_shape_or_dtype_reallocates_only_that_buffer():
    pool = staging.StagingPool()
    pool.stage([{"a": torch.zeros(10), "b": torch.zeros(20), "c": torch.zeros(5)}]).release()
    changed = {"a": torch.ones(10), "b": torch.ones(21), "c": torch.ones(5, dtype=torch.float64)}
    staged = pool.stage([changed])
    assert staged.allocated_bytes == 21 * 4 + 5 * 8
    assert_state_equal(staged.trees[0], changed)
    staged.release()
    assert pool.held_bytes == staged.nbytes


def test_the_save_being_written_keeps_its_buffers_while_the_next_one_stages():
    pool = staging.StagingPool(max_sets=2)
    in_flight = pool.stage([_state(0)])
    staging_now = pool.stage([_state(1)])
    assert set(_ptrs(in_flight.trees)).isdisjoint(_ptrs(staging_now.trees))
    assert_state_equal(in_flight.trees[0], _state(0))


def test_staging_is_bounded_and_waits_for_a_release():
    pool = staging.StagingPool(max_sets=1)
    held = pool.stage([_state(0)])
    with pytest.raises(TimeoutError, match="still being written"):
        pool.stage([_state(1)], timeout=0.05)
    held.release()
    held.release()  # a second release is a no-op, not a double return
    assert pool.stage([_state(1)], timeout=0.05).allocated_bytes == 0


def test_clear_frees_idle_buffers_and_drops_sets_still_in_use_when_they_return():
    pool = staging.StagingPool()
    pool.stage([_state(0)]).release()
    lent = pool.stage([_state(1)])
    pool.clear()
    assert pool.held_bytes == 0
    lent.release()
    assert pool.held_bytes == 0
    assert pool.stage([_state(2)]).allocated_bytes > 0


def test_structure_and_non_tensor_leaves_are_preserved():
    point = collections.namedtuple("point", "x y")
    tree = collections.OrderedDict(p=point(torch.arange(3), 7), items=[torch.ones(2), "s", None])
    out = staging.StagingPool().stage([tree]).trees[0]
    assert type(out) is collections.OrderedDict and type(out["p"]) is point
    assert out["p"].y == 7 and out["items"][1:] == ["s", None]
    assert torch.equal(out["p"].x, torch.arange(3)) and torch.equal(out["items"][0], torch.ones(2))


def test_to_host_copies_cpu_tensors_only_when_asked():
    t = torch.ones(4)
    assert transfer.to_host({"t": t}, copy=False)["t"].data_ptr() == t.data_ptr()
    assert transfer.to_host({"t": t}, copy=True)["t"].data_ptr() != t.data_ptr()


@pytest.mark.xla
def test_xla_tensors_are_snapshotted_on_the_device_and_reach_the_host_through_the_transfer():
    torch_xla = pytest.importorskip("torch_xla")
    device = torch_xla.device()
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(device)
    cpu = torch.ones(2)
    staged = staging.StagingPool().stage([{"w": w, "cpu": cpu}])
    w.add_(100.0)
    cpu.add_(100.0)
    torch_xla.sync()
    out = staged.trees[0]
    assert out["w"].device.type == "meta" and out["cpu"].device.type == "cpu"  # a stand-in, the bytes travel
    assert staged.snapshot is not None and staged.snapshot.snapshot_bytes == 48
    host = staged.transfer.host(out["w"])
    assert host.device.type == "cpu" and torch.equal(host, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(out["cpu"], torch.ones(2))
    staged.transfer.close()


def test_tensors_not_needed_become_metadata_only():
    """A DP replica stages only what it writes; the rest keep shape, dtype and NxD's expert flag, and no data."""
    state = _state()
    expert = state["model"]["b"]
    expert.expert_model_parallel = True
    needed = [id(state["model"]["w"])]
    staged = staging.StagingPool().stage([state], needed=needed)
    out = staged.trees[0]
    assert out["model"]["w"].device.type == "cpu" and torch.equal(out["model"]["w"], state["model"]["w"])
    assert out["model"]["tied"] is out["model"]["w"]  # sharing survives
    skipped = out["model"]["b"]
    assert skipped.device.type == "meta" and skipped.shape == expert.shape and skipped.dtype == expert.dtype
    assert skipped.expert_model_parallel is True
    assert staged.nbytes == state["model"]["w"].numel() * 4
    with pytest.raises((RuntimeError, NotImplementedError)):
        skipped.cpu()  # no data to write by mistake
    staged.release()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_new_staging_buffers_are_faulted_in_before_the_copy_touches_them():
    """A first staging's time is first-touch page faults; helper threads take them ahead of the copy."""
    from nxd_ckpt.save.staging import _Populator

    buffer = torch.empty(128 << 20, dtype=torch.uint8)  # reserved, not touched: not resident yet
    before = _rss()
    with _Populator([buffer]) as populator:
        populator.wait_for(buffer)
        grown = _rss() - before
    if grown == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (before 5.14): the copy takes the faults")
    assert grown >= 120 << 20


def test_prepared_buffers_are_faulted_in_and_taken_by_the_first_stage_without_allocating():
    """``prepare`` reserves the next stage's buffers and faults them in on a background thread: the first
    stage then allocates nothing and copies into exactly those buffers."""
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1024), "step": torch.tensor(3)}
    pool = staging.StagingPool()
    reserved = pool.prepare([state])
    assert reserved == sum(t.numel() * t.element_size() for t in state.values())
    assert pool.wait_prepared(timeout=30)
    prepared = {t.data_ptr() for t in pool._free[0].buffers}
    lease = pool.stage([state])
    assert lease.allocated_bytes == 0
    assert set(_ptrs(lease.trees)) == prepared
    assert_state_equal(lease.trees[0], state)
    lease.release()
    assert pool.prepare([state]) == 0  # the pool already holds a set: nothing more is reserved


def test_a_stage_of_part_of_the_prepared_state_takes_matching_buffers_and_drops_the_rest():
    """A replica's xser save stages only its share: buffers are matched by shape and dtype, not position."""
    state = {"a": torch.randn(64, 32), "b": torch.randn(32), "c": torch.randn(16, 8).double()}
    pool = staging.StagingPool()
    pool.prepare([state])
    pool.wait_prepared(timeout=30)
    lease = pool.stage([{"c": state["c"], "a": state["a"]}])
    assert lease.allocated_bytes == 0
    assert_state_equal(lease.trees[0], {"c": state["c"], "a": state["a"]})
    lease.release()
    assert pool.held_bytes == (64 * 32 * 4) + (16 * 8 * 8)  # the unused buffer of "b" is freed


def test_clearing_the_pool_stops_the_preparing_thread_before_its_buffers_are_freed(monkeypatch):
    """``clear`` (``finalize``) frees the prepared buffers: the thread faulting them in stops first. (Populating
    freed memory fails, and a failure turns pre-faulting off for the rest of the process.)"""
    from nxd_ckpt import pages

    monkeypatch.setattr(pages, "_supported", None)
    pool = staging.StagingPool()
    pool.prepare([{f"w{i}": torch.empty(64 << 20, dtype=torch.uint8) for i in range(8)}])  # 512 MiB at nice 19
    thread = pool._prepared._thread if pool._prepared is not None else None
    pool.clear()
    assert thread is None or not thread.is_alive()
    assert pool.held_bytes == 0
    time.sleep(0.2)
    assert pages._supported is not False  # nothing populated freed memory
