"""async_save end to end: snapshot semantics, commit without further calls, retention, errors, kill, exit.

The failures are real: a Storage subclass whose writes raise ENOSPC on one file, a process SIGKILLed while its
writer thread is inside a file, an interpreter that exits with a save still being written.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.gated_storage import GatedStorage
from harness.multiprocess import run_with_ranks
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps
from nxd_ckpt.tree import map_tensors


def _snapshot(model, opt) -> tuple[dict, dict]:
    return map_tensors(model.state_dict(), torch.clone), map_tensors(opt.state_dict(), torch.clone)


def _mutate_every_tensor(model, opt) -> None:
    """What an optimizer step does to the live state, only more visibly: change every tensor in place."""
    with torch.no_grad():
        for state in (model.state_dict(), opt.state_dict()["state"]):
            map_tensors(state, lambda t: t.add_(1000))


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@run_with_ranks(2)
def test_async_saves_snapshot_commit_by_themselves_and_keep_newest_n(tmp_path):
    rank = dist.get_rank()
    ckpt = str(tmp_path / "ckpt")
    records = _Records()
    logger = logging.getLogger("nxd_ckpt")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    model, opt, sched = make_training(seed=0)  # DP replicas of one model; each rank writes its optimizer file
    expected, reports = {}, {}
    for step in range(1, 5):
        train_steps(model, opt, sched, 1, seed=step)
        with torch.no_grad():  # per-rank optimizer state, as ZeRO-1 shards are
            for param_state in opt.state.values():
                param_state["exp_avg"].add_(rank)
        tag = f"step_{step}"
        expected[tag] = _snapshot(model, opt)
        reports[tag] = nxd.save_checkpoint(
            ckpt, tag, model=model, optimizer=opt, num_kept_ckpts=2, async_save=True, zero1_optimizer=True
        )
        _mutate_every_tensor(model, opt)  # right after the call returns, while the files are being written
    # Nothing else is called: the last save must become complete, and retention must run, by themselves.
    _wait_for(lambda: os.path.exists(os.path.join(ckpt, "step_4", "done")), "'done' of step_4")
    _wait_for(lambda: not os.path.exists(os.path.join(ckpt, "step_2")), "retention of step_2")
    nxd.finalize_checkpoint()
    assert nxd.list_checkpoint_tags(ckpt) == ["step_3", "step_4"]
    assert sorted(os.listdir(ckpt)) == [".nxd-tags.json", "step_3", "step_4"]  # + the tag index of latest
    for tag in ("step_3", "step_4"):
        loaded_model, loaded_opt, _ = make_training(seed=42)
        nxd.load_checkpoint(ckpt, tag, model=loaded_model, optimizer=loaded_opt)
        assert_state_equal(loaded_model.state_dict(), expected[tag][0])
        assert_state_equal(loaded_opt.state_dict(), expected[tag][1])
    for report in reports.values():
        assert report.completed and report.async_save and report.bytes_written > 0 and report.files_written >= 1
        assert report.write_s > 0 and report.total_s >= report.blocked_s
    assert reports["step_1"].staging_allocated_bytes > 0
    assert [r.staging_allocated_bytes for t, r in reports.items() if t != "step_1"] == [0, 0, 0]  # reused
    saved_lines = [m for m in records.messages if m.startswith("saved step_")]
    if rank == 0:
        assert len(saved_lines) == 4 and all("(async)" in m and "training blocked" in m for m in saved_lines)
        assert sum(m.startswith("retention deleted") for m in records.messages) == 2
    else:
        assert saved_lines == []
    logger.removeHandler(records)


class FailingStorage(LocalStorage):
    """Local storage whose writes of files matching ``fail_on`` raise ENOSPC, as a full disk does."""

    def __init__(self, root: str, fail_on: tuple[str, ...]) -> None:
        super().__init__(root)
        self.fail_on = fail_on

    @contextlib.contextmanager
    def open_write(self, path: str):
        if any(pattern in path for pattern in self.fail_on):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.root, path))
        with super().open_write(path) as f:
            yield f


@run_with_ranks(2)
def test_writer_failure_surfaces_on_the_next_call_on_every_rank_and_leaves_no_done(tmp_path):
    rank = dist.get_rank()
    ckpt = str(tmp_path / "ckpt")
    storage = FailingStorage(ckpt, fail_on=("step_2/optim/dp_rank_01", "step_4/optim/dp_rank_01"))
    model, opt, _ = make_training(seed=rank)
    kw = {"model": model, "optimizer": opt, "zero1_optimizer": True, "async_save": True}
    nxd.save_checkpoint(storage, "step_1", **kw)
    nxd.save_checkpoint(storage, "step_2", **kw)  # rank 1's optimizer file hits a full disk in the background

    with pytest.raises(nxd.AsyncSaveError) as info:  # the next call raises, on every rank, before starting
        nxd.save_checkpoint(storage, "step_3", **kw)
    if rank == 1:
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    else:
        assert "rank 1" in str(info.value.__cause__) and "No space left on device" in str(info.value.__cause__)
    assert not os.path.exists(os.path.join(ckpt, "step_2", "done"))
    assert not os.path.exists(os.path.join(ckpt, "step_3"))
    assert nxd.latest_checkpoint_tag(ckpt) == "step_1"
    nxd.load_checkpoint(ckpt, model=make_training(seed=7)[0])

    nxd.save_checkpoint(storage, "step_4", **kw)  # fails again; this time finalize reports it
    with pytest.raises(nxd.AsyncSaveError, match="step_4") as info:
        nxd.finalize_checkpoint()
    assert info.value.__cause__ is not None
    assert not os.path.exists(os.path.join(ckpt, "step_4", "done"))
    nxd.finalize_checkpoint()  # raised once: nothing left to report
    nxd.save_checkpoint(storage, "step_5", **kw).wait()  # the job goes on
    nxd.finalize_checkpoint()
    assert nxd.list_checkpoint_tags(ckpt) == ["step_1", "step_5"]


def test_a_new_save_waits_for_the_previous_one_and_logs_how_long(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nxd_ckpt")
    gate = threading.Event()
    storage = GatedStorage(str(tmp_path), gate)
    state = {"w": torch.ones(64, 64)}
    first = nxd.save_checkpoint(storage, "step_1", model=state, async_save=True)
    assert not first.completed and not os.path.exists(tmp_path / "step_1" / "done")
    threading.Timer(1.0, gate.set).start()  # opens while the next save is already waiting
    second = nxd.save_checkpoint(storage, "step_2", model=state, async_save=True)
    assert first.completed and os.path.exists(tmp_path / "step_1" / "done")
    assert second.waited_s > 0 and second.blocked_s >= second.waited_s
    assert any("save of step_2 waited" in r.getMessage() for r in caplog.records)
    nxd.finalize_checkpoint()
    assert second.completed and nxd.list_checkpoint_tags(tmp_path) == ["step_1", "step_2"]


_CHILD = textwrap.dedent(
    """
    import contextlib, os, sys, time
    import torch
    import nxd_ckpt as nxd
    from nxd_ckpt.storage import LocalStorage

    mode, ckpt, signal_path = sys.argv[1:4]

    class _StallingFile:
        def __init__(self, f):
            self.f = f
        def write(self, data):
            self.f.write(bytes(data)[: max(1, len(data) // 2)])
            self.f.flush()
            os.fsync(self.f.fileno())
            open(signal_path, "w").close()
            time.sleep(3600)  # killed here, half-way through the file
        def __getattr__(self, name):
            return getattr(self.f, name)

    class StallingStorage(LocalStorage):
        @contextlib.contextmanager
        def open_write(self, path):
            with super().open_write(path) as f:
                yield _StallingFile(f) if "step_2/model" in path else f

    class SlowStorage(LocalStorage):
        @contextlib.contextmanager
        def open_write(self, path):
            time.sleep(0.2)
            with super().open_write(path) as f:
                yield f

    state = {"w": torch.full((256, 256), 1.0)}
    nxd.save_checkpoint(ckpt, "step_1", model=state)
    state["w"].fill_(2.0)
    if mode == "kill":
        nxd.save_checkpoint(StallingStorage(ckpt), "step_2", model=state, async_save=True)
        state["w"].fill_(3.0)
        time.sleep(3600)  # "training" goes on until the process is killed
    else:
        nxd.save_checkpoint(SlowStorage(ckpt), "step_2", model=state, user_content={"x": 1}, async_save=True)
        state["w"].fill_(3.0)
        # the script ends with the save still being written and without finalize_checkpoint()
    """
)


def _run_child(mode: str, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode, str(tmp_path / "ckpt"), str(tmp_path / "writing")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path):
    child = _run_child("kill", tmp_path)
    try:
        _wait_for(lambda: (tmp_path / "writing").exists() or child.poll() is not None, "the child's write")
        assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    ckpt = str(tmp_path / "ckpt")
    step_2 = os.listdir(os.path.join(ckpt, "step_2", "model"))
    assert step_2 and all(".tmp-" in name for name in step_2)  # a half-written file, never renamed into place
    assert not os.path.exists(os.path.join(ckpt, "step_2", "done"))
    assert nxd.latest_checkpoint_tag(ckpt) == "step_1"
    loaded: dict = {}
    nxd.load_checkpoint(ckpt, model=loaded)
    assert torch.equal(loaded["w"], torch.full((256, 256), 1.0))


def test_interpreter_exit_waits_for_the_save_being_written(tmp_path):
    child = _run_child("exit", tmp_path)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out.decode()
    ckpt = str(tmp_path / "ckpt")
    assert nxd.list_checkpoint_tags(ckpt) == ["step_1", "step_2"]
    loaded: dict = {}
    assert nxd.load_checkpoint(ckpt, model=loaded) == {"x": 1}
    assert torch.equal(loaded["w"], torch.full((256, 256), 2.0))  # the state at call time, not 3.0


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@run_with_ranks(2)
def test_async_saves_under_a_host_memory_budget_hold_the_values_at_the_call(tmp_path, use_xser):
    """Two ranks: a budget smaller than most tensors (they are written straight from the live tensors
    while the call waits) and one that holds some of them (staged, written after the call returned); with and
    without the memory tier. Every tag loads exactly the state as it was at the call."""
    ckpt = str(tmp_path / "ckpt")
    tier = nxd.MemoryTier(dir=str(tmp_path / "mem"), replicas=0, max_copies=8)
    model, opt, sched = make_training(seed=0)
    expected, reports = {}, {}
    for step, (budget, memory_tier) in enumerate([("4KiB", None), (64 << 10, None), ("16KiB", tier)], start=1):
        train_steps(model, opt, sched, 1, seed=step)
        tag = f"step_{step}"
        expected[tag] = _snapshot(model, opt)
        reports[tag] = nxd.save_checkpoint(
            ckpt, tag, model=model, optimizer=opt, async_save=True, zero1_optimizer=True, use_xser=use_xser,
            host_memory_budget=budget, memory_tier=memory_tier,
        )  # fmt: skip
        _mutate_every_tensor(model, opt)
    nxd.finalize_checkpoint()
    for tag, report in reports.items():
        assert report.completed and 0.0 <= report.budget_wait_s <= report.blocked_s
        loaded_model, loaded_opt, _ = make_training(seed=42)
        nxd.load_checkpoint(ckpt, tag, model=loaded_model, optimizer=loaded_opt)
        assert_state_equal(loaded_model.state_dict(), expected[tag][0])
        assert_state_equal(loaded_opt.state_dict(), expected[tag][1])


@run_with_ranks(2)
def test_prepare_async_save_makes_the_first_save_copy_into_reserved_memory(tmp_path):
    """After ``prepare_async_save`` the first async save of the process allocates nothing (its buffers were
    reserved and faulted in beside training), snapshots correctly and loads bit-exactly; the second save
    still reuses them."""
    rank = dist.get_rank()
    ckpt = str(tmp_path / "ckpt")
    model, opt, sched = make_training(seed=5)
    train_steps(model, opt, sched, 1, seed=1)  # replicas stay equal; each rank saves its own optimizer shard
    reserved = nxd.prepare_async_save(model=model, optimizer=opt)
    assert reserved > 0
    assert nxd.prepare_async_save(model=model, optimizer=opt) == 0  # already reserved
    train_steps(model, opt, sched, 1, seed=2)
    with torch.no_grad():
        for param_state in opt.state.values():
            param_state["exp_avg"].add_(rank)
    expected = _snapshot(model, opt)
    first = nxd.save_checkpoint(ckpt, "step_1", model=model, optimizer=opt, async_save=True, zero1_optimizer=True)
    _mutate_every_tensor(model, opt)
    second = nxd.save_checkpoint(ckpt, "step_2", model=model, optimizer=opt, async_save=True, zero1_optimizer=True)
    nxd.finalize_checkpoint()
    assert first.staging_allocated_bytes == 0 and second.staging_allocated_bytes == 0
    loaded_model, loaded_opt, _ = make_training(seed=42)
    nxd.load_checkpoint(ckpt, "step_1", model=loaded_model, optimizer=loaded_opt)
    assert_state_equal(loaded_model.state_dict(), expected[0])
    assert_state_equal(loaded_opt.state_dict(), expected[1])
