"""``on_save_error="warn"`` keeps training going through a failed save; one exception type on every rank."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pytest
import torch

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt.ranks import coordinator as dist
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import TinyMLP, make_training, train_steps

pytestmark = pytest.mark.device_independent  # what a failed save leaves: runs once, in the CPU lane


class FailingTagStorage(LocalStorage):
    """Local storage that refuses (ENOSPC) every write under one tag: a full disk during that save only."""

    def __init__(self, root: str, failing_tag: str | None) -> None:
        super().__init__(root)
        self.failing_tag = failing_tag

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if self.failing_tag is not None and path.startswith(self.failing_tag + "/"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        with super().open_write(path) as f:
            yield f

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        with self.open_write(path) as f:
            f.write(data)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("async_save", [True, False])
def test_warn_policy_keeps_training_through_a_failed_save(tmp_path, async_save):
    _train_through_a_failed_save(tmp_path=tmp_path, async_save=async_save)


@run_with_ranks(2)
def _train_through_a_failed_save(tmp_path, async_save):
    rank = dist.world_rank()
    ckpt = str(tmp_path / "ckpt")
    # The disk fills up on rank 1 only, during the save of step_2; rank 0's writes succeed.
    storage = FailingTagStorage(ckpt, "step_2" if rank == 1 else None)
    errors = _Errors()
    logging.getLogger("nxd_ckpt").addHandler(errors)
    model, opt, sched = make_training(seed=0)
    reports = {}
    for step in range(1, 5):
        train_steps(model, opt, sched, steps=1, seed=step)
        reports[step] = nxd.save_checkpoint(
            storage, f"step_{step}", model=model, optimizer=opt, async_save=async_save, on_save_error="warn"
        )
        if step == 2:
            nxd.get_manager().wait_pending()  # the failed save is over: the previous complete one is latest
            assert nxd.latest_checkpoint_tag(ckpt) == "step_1"
            assert not os.path.exists(os.path.join(ckpt, "step_2", "done"))
    nxd.finalize_checkpoint()  # nothing raises: the failure was reported instead
    logging.getLogger("nxd_ckpt").removeHandler(errors)

    failed = reports[2]
    assert not failed.completed and failed.error is not None and "step_2" in failed.error, failed
    assert all(reports[s].completed and reports[s].error is None for s in (1, 3, 4))
    if async_save:  # the next save's report says that a background save failed
        assert len(reports[3].earlier_failures) == 1 and reports[3].earlier_failures[0].startswith("step_2: ")
        assert reports[4].earlier_failures == []
    # Logged on every rank (errors pass the master-only filter), naming the tag and the policy.
    assert any("step_2" in line and "on_save_error='warn'" in line for line in errors.lines), errors.lines
    # The next saves succeeded, the last one is latest, and it holds the trained state.
    assert nxd.list_checkpoint_tags(ckpt) == ["step_1", "step_3", "step_4"]
    restored = TinyMLP()
    nxd.load_checkpoint(ckpt, model=restored)
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor.cpu()), name


def test_on_save_error_rejects_unknown_policies(tmp_path):
    model, _, _ = make_training(seed=0)
    with pytest.raises(ValueError, match="on_save_error must be 'raise' or 'warn', got 'ignore'"):
        nxd.save_checkpoint(str(tmp_path), "step_1", model=model, on_save_error="ignore")
    assert not os.path.exists(tmp_path / "step_1")


def test_warn_does_not_hide_a_bad_call(tmp_path):
    """Only failures of the save itself are warned about; a wrong argument still raises."""
    model, _, _ = make_training(seed=0)
    with pytest.raises(ValueError, match="num_kept_ckpts"):
        nxd.save_checkpoint(str(tmp_path), "step_1", model=model, num_kept_ckpts=0, on_save_error="warn")


@dataclass
class _Position:
    """A user class inside per-rank state: loading it needs allow_pickle=True."""

    index: int


class _Loader:
    def __init__(self, index: int) -> None:
        self.position = _Position(index)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


@run_with_ranks(2)
def test_refused_pickle_is_the_same_exception_type_on_every_rank(tmp_path):
    """The master reads the gathered per-rank file and refuses its pickled class: every rank raises
    UnsafeCheckpointError (not RemoteRankError elsewhere), naming rank 0 as the origin."""
    rank = dist.world_rank()
    ckpt = str(tmp_path / "ckpt")
    model, _, _ = make_training(seed=0)
    nxd.save_checkpoint(ckpt, "step_1", model=model, rank_state=_Loader(rank), rank_state_mode="gather")
    with pytest.raises(nxd.UnsafeCheckpointError) as raised:
        nxd.load_checkpoint(ckpt, model=TinyMLP(), rank_state=_Loader(-1))
    assert type(raised.value) is nxd.UnsafeCheckpointError
    assert raised.value.origin_rank == 0
    if rank != 0:
        assert str(raised.value).startswith("rank 0 failed while reading the per-rank state")
    # With the opt-in, the same checkpoint loads on every rank.
    loader = _Loader(-1)
    nxd.load_checkpoint(ckpt, model=TinyMLP(), rank_state=loader, allow_pickle=True)
    assert loader.position == _Position(rank)
