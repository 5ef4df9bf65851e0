"""Deadlines with a named culprit, on real gloo ranks: a rank stuck before the save, in a write, in the commit.

Every rank raises CheckpointTimeoutError within the deadline (``timeout=``), naming the phase and the rank it
waited for, and the master's log says whom it is waiting for meanwhile. The stuck storage calls really block
(an Event nobody sets until the test is over): the watchdog is what lets that rank raise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import pytest

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt.errors import CheckpointTimeoutError, StorageStallError
from nxd_ckpt.format import layout
from nxd_ckpt.ranks import coordinator as dist
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import make_training

pytestmark = pytest.mark.device_independent  # deadlines of the ranks' coordination: runs once, in the CPU lane

DEADLINE_S = 3.0
SLACK_S = 8.0
"""Raising may take the deadline plus polling and a loaded 2-core machine: seconds, where without deadlines it
would take the process group's timeout (120 s here, 30 minutes by default)."""
SETUP_TIMEOUT_S = 120.0
"""The deadline of the saves around the one under test: freshly spawned ranks on a loaded machine reach their
first save seconds apart, which is not what these tests are about."""


class _Records(logging.Handler):
    """Keeps the nxd_ckpt log records of this rank."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _captured_log() -> Iterator[_Records]:
    logger = logging.getLogger("nxd_ckpt")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class BlockingStorage(LocalStorage):
    """Local storage whose writes of files whose path contains ``block`` hang (after ``after_bytes`` bytes)
    until ``release`` is set: a hung mount, as far as the caller can tell."""

    def __init__(self, root: str, block: str, after_bytes: int = 0) -> None:
        super().__init__(root)
        self.block = block
        self.after_bytes = after_bytes
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.moved = 0
        """Bytes of the blocked file written before it blocked."""

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            yield _BlockingStream(self, f) if self.block in path else f  # type: ignore[misc]

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        with self.open_write(path) as f:
            f.write(data)


class _BlockingStream:
    def __init__(self, owner: BlockingStorage, target: BinaryIO) -> None:
        self._owner, self._target, self._written = owner, target, 0

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if self._written + n > self._owner.after_bytes:
            self._owner.moved = self._written
            self._owner.blocked.set()
            self._owner.release.wait(120)
        self._written += n
        return self._target.write(data)

    def flush(self) -> None:
        self._target.flush()


def _wait_for(flags: list[Any], timeout_s: float) -> None:
    """Poll until every file in ``flags`` exists (another rank's word that it got there), for ``timeout_s`` at most."""
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in flags) and time.monotonic() < deadline:
        time.sleep(0.05)


def _save(storage: Any, tag: str, **options: Any) -> nxd.SaveReport:
    model, opt, _ = make_training(seed=0)
    return nxd.save_checkpoint(storage, tag, model=model, optimizer=opt, **{"timeout": DEADLINE_S, **options})


@run_with_ranks(3)
def test_rank_that_never_reaches_the_save_is_named_by_every_rank(tmp_path):
    rank = dist.world_rank()
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt, "step_1", timeout=SETUP_TIMEOUT_S)
    with _captured_log() as log:
        start = time.monotonic()
        if rank == 1:  # busy elsewhere (a data loader, a hung kernel) until the others gave up
            _wait_for([tmp_path / f"rank{r}_gave_up" for r in (0, 2)], DEADLINE_S + SLACK_S + 60)
        with pytest.raises(CheckpointTimeoutError) as raised:
            _save(ckpt, "step_2")
        elapsed = time.monotonic() - start
        if rank != 1:
            (tmp_path / f"rank{rank}_gave_up").write_text("1")
    error = raised.value
    if rank == 1:  # arriving late, it learns that the others gave up instead of waiting for them
        assert error.missing_ranks == (1,) and "too late" in str(error)
    else:
        assert elapsed < DEADLINE_S + SLACK_S, f"rank {rank} raised after {elapsed:.1f} s"
        assert error.missing_ranks == (1,), str(error)
        assert "starting checkpoint 'step_2'" in error.phase and "[1]" in str(error)
    if rank == 0:  # the master said whom it was waiting for, while it waited
        assert any("waiting for rank(s) [1] in phase 'starting checkpoint 'step_2''" in line for line in log.lines), (
            log.lines
        )
    assert nxd.latest_checkpoint_tag(ckpt) == "step_1"
    # Every rank took the same step and raised; once the straggler caught up, the next save works.
    flag = tmp_path / "rank1_caught_up"
    if rank == 1:
        flag.write_text("1")
    _wait_for([flag], 60)
    _save(ckpt, "step_3", timeout=SETUP_TIMEOUT_S)
    assert nxd.latest_checkpoint_tag(ckpt) == "step_3"


@pytest.mark.parametrize(
    "async_save, rank1_timeout",
    [
        # Rank 1's own deadline is longer: the master's commit deadline passes first and it names rank 1.
        (False, 3 * DEADLINE_S),
        # The same deadline everywhere: rank 1's watchdog (half the deadline) fires first, and its
        # StorageStallError reaches the master's commit and is raised there too, as the same type.
        (True, DEADLINE_S),
    ],
)
def test_rank_stuck_in_a_write(tmp_path, async_save, rank1_timeout):
    _stuck_in_a_write(tmp_path=tmp_path, async_save=async_save, rank1_timeout=rank1_timeout)


@run_with_ranks(2)
def _stuck_in_a_write(tmp_path, async_save, rank1_timeout):
    rank = dist.world_rank()
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt, "step_1", timeout=SETUP_TIMEOUT_S)
    # Rank 1 writes one file of its own (its RNG state); that write hangs after some bytes.
    storage = BlockingStorage(ckpt, block="rank_state_00001" if rank == 1 else "never", after_bytes=1000)
    timeout = rank1_timeout if rank == 1 else DEADLINE_S
    try:
        with _captured_log() as log:
            start = time.monotonic()
            with pytest.raises(CheckpointTimeoutError) as raised:
                model, opt, _ = make_training(seed=0)
                report = nxd.save_checkpoint(
                    storage, "step_2", model=model, optimizer=opt, save_rng=True, async_save=async_save, timeout=timeout
                )
                report.wait()  # async: the background write raises; nxd.finalize_checkpoint() would too
            elapsed = time.monotonic() - start
        error = raised.value
        assert elapsed < timeout + SLACK_S, f"rank {rank} raised after {elapsed:.1f} s"
        if rank == 1:  # the watchdog: the storage call made no progress, named with the file and bytes moved
            assert isinstance(error, StorageStallError), repr(error)
            assert storage.blocked.is_set() and error.path == layout.rank_state_file("step_2", 1), repr(error)
            assert error.bytes_moved == storage.moved and f"({storage.moved} bytes moved)" in str(error)
            assert error.path in str(error)
        elif rank1_timeout > DEADLINE_S:  # the master waited in the commit, logging whom for, then named it
            assert error.missing_ranks == (1,) and "commit of 'step_2'" in error.phase, repr(error)
            assert any("waiting for rank(s) [1] in phase 'commit of 'step_2'" in line for line in log.lines), log.lines
        else:  # rank 1's own error, as its own type, naming its rank and file
            assert type(error) is StorageStallError and error.origin_rank == 1, repr(error)
            assert error.path == layout.rank_state_file("step_2", 1) and str(error).startswith("rank 1 failed")
        with contextlib.suppress(Exception):
            nxd.finalize_checkpoint()  # the async error, already seen through report.wait()
    finally:
        storage.release.set()
    assert nxd.latest_checkpoint_tag(ckpt) == "step_1"


@run_with_ranks(2)
def test_master_stuck_in_the_commit(tmp_path):
    rank = dist.world_rank()
    ckpt = str(tmp_path / "ckpt")
    _save(ckpt, "step_0", timeout=SETUP_TIMEOUT_S)
    storage = BlockingStorage(ckpt, block="nxd_ckpt.json" if rank == 0 else "never")
    try:
        with _captured_log() as log:
            start = time.monotonic()
            with pytest.raises(CheckpointTimeoutError) as raised:
                _save(storage, "step_1")
            elapsed = time.monotonic() - start
        error = raised.value
        assert elapsed < DEADLINE_S + SLACK_S, f"rank {rank} raised after {elapsed:.1f} s"
        assert "commit" in error.phase, str(error)
        if rank == 0:  # its own write of the metadata hung: the watchdog names the file
            assert storage.blocked.is_set()
            assert isinstance(error, StorageStallError), repr(error)
            assert error.path == layout.tag_path("step_1", layout.METADATA_FILE), repr(error)
        else:  # waited for rank 0's outcome and said so; or received rank 0's own stall error
            assert error.missing_ranks == (0,) or error.origin_rank == 0, repr(error)
            assert any("waiting for rank(s) [0]" in line for line in log.lines) or error.origin_rank == 0
    finally:
        storage.release.set()
    assert nxd.latest_checkpoint_tag(ckpt) == "step_0"
