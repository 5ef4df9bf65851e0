"""Injected write errors (ENOSPC, EIO, EACCES) at many points of a save: a clear error naming the file and the
cause, no ``done``, and the older checkpoint intact; the next save works."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import pytest
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.crashloop import model_state, optimizer_state
from harness.multiprocess import run_with_ranks
from nxd_ckpt.format import layout
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.device_independent

ERRNOS = [errno.ENOSPC, errno.EIO, errno.EACCES]
POINTS_PER_ERRNO = 5


class FailingStorage(LocalStorage):
    """Local storage whose ``fail_at``-th ``write()`` (counted over all files) raises ``OSError(err)``."""

    def __init__(self, root: str, fail_at: int | None = None, err: int = errno.ENOSPC) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.err = err
        self.writes = 0
        self._lock = threading.Lock()

    def count_write(self, path: str) -> None:
        if path == layout.TAG_INDEX_FILE:  # written after 'done': see test_a_failed_index_write_...
            return
        with self._lock:
            n = self.writes
            self.writes += 1
        if n == self.fail_at:
            raise OSError(self.err, os.strerror(self.err), path)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            yield _FailingStream(self, f, path)  # type: ignore[misc]


class _FailingStream:
    def __init__(self, owner: FailingStorage, target: BinaryIO, path: str) -> None:
        self._owner, self._target, self._path = owner, target, path

    def write(self, data: Any) -> int:
        self._owner.count_write(self._path)
        return self._target.write(data)

    def flush(self) -> None:
        self._target.flush()


def _save(storage: Any, step: int, **options: Any) -> None:
    nxd.save_checkpoint(
        storage,
        f"step_{step}",
        model=model_state(step),
        optimizer=optimizer_state(step),
        user_content={"step": step},
        num_kept_ckpts=1,
        **options,
    )
    if options.get("async_save"):
        nxd.finalize_checkpoint()


def _error_text(e: BaseException) -> str:
    parts = []
    while e is not None:
        parts.append(str(e))
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def _assert_step_1_intact(root: str) -> None:
    assert nxd.list_checkpoint_tags(root) == ["step_1"]
    assert not os.path.exists(os.path.join(root, "step_2", "done"))
    assert nxd.verify(root, "step_1").ok
    model, optim = {}, {}
    assert nxd.load_checkpoint(root, model=model, optimizer=optim) == {"step": 1}
    assert_state_equal(model, model_state(1))
    assert_state_equal(optim, optimizer_state(1))


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_write_errors_mid_save(tmp_path, use_xser, async_save):
    options = {"use_xser": use_xser, "async_save": async_save}
    probe = FailingStorage(str(tmp_path / "probe"))
    _save(probe, 1, **options)
    total = probe.writes  # write() calls one save makes
    points = sorted({round(i * (total - 1) / (POINTS_PER_ERRNO - 1)) for i in range(POINTS_PER_ERRNO)})
    root = str(tmp_path / "ckpt")
    _save(LocalStorage(root), 1, **options)
    tried = 0
    for err in ERRNOS:
        for fail_at in points:
            with pytest.raises(Exception) as raised:
                _save(FailingStorage(root, fail_at, err), 2, **options)
            text = _error_text(raised.value)
            assert os.strerror(err) in text and "/step_2/" in text, text
            nxd.reset_manager()
            _assert_step_1_intact(root)
            tried += 1
    _save(LocalStorage(root), 2, **options)  # the directory is still usable
    assert nxd.list_checkpoint_tags(root) == ["step_2"] and nxd.verify(root).ok
    print(f"\n[write errors] xser={use_xser} async={async_save}: {tried} injected errors over {total} writes")


class _IndexFails(LocalStorage):
    """Local storage on which only the root's tag index cannot be written."""

    def write_bytes(self, path: str, data: Any) -> None:
        if path == layout.TAG_INDEX_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        super().write_bytes(path, data)


def test_a_failed_index_write_leaves_the_committed_save_and_latest_correct(tmp_path, caplog):
    """The tag index is written after 'done': failing to write it is logged, the save stands, latest reads tags."""
    root = str(tmp_path / "ckpt")
    _save(LocalStorage(root), 1)
    _save(_IndexFails(root), 2)
    assert "could not update .nxd-tags.json" in caplog.text
    assert nxd.latest_checkpoint_tag(root) == "step_2" and nxd.verify(root).ok


def _rank1_fails(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    _save(root, 1, use_xser=True)
    storage = FailingStorage(root, 0, errno.ENOSPC) if dist.get_rank() == 1 else LocalStorage(root)
    with pytest.raises(Exception) as raised:  # every rank learns that the save failed, and why
        _save(storage, 2, use_xser=True)
    assert "No space left on device" in _error_text(raised.value), _error_text(raised.value)
    dist.barrier()
    _assert_step_1_intact(root)  # a collective load, on both ranks


@run_with_ranks(2)
def test_one_rank_out_of_space(tmp_path):
    _rank1_fails(tmp_path)
