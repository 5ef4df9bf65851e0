"""A load reads the optimizer's files on a thread of its own while the model's are read (the storage stays busy
while the model's bytes are copied), waits for that thread whatever happens, and raises what either read raised."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout
from nxd_ckpt.storage import DelegatingStorage, LocalStorage


def _part_of(path: str) -> str | None:
    """``model`` or ``optim`` for the parts of those state files (xser tensor files included), else None."""
    parts = layout.state_file_of(path).split("/")
    return parts[1] if len(parts) > 2 and parts[1] in (layout.MODEL_DIR, layout.OPTIM_DIR) else None


class _Gated(DelegatingStorage):
    """Model files wait (up to ``wait_s``) until an optimizer file has been opened; records what overlapped."""

    def __init__(self, inner: LocalStorage, wait_s: float = 10.0, fail: str | None = None) -> None:
        super().__init__(inner)
        self.optimizer_opened = threading.Event()
        self.model_waited_for_optimizer: list[bool] = []
        self.threads: dict[str, set[str]] = {layout.MODEL_DIR: set(), layout.OPTIM_DIR: set()}
        self._wait_s = wait_s
        self._fail = fail

    def _gate(self, path: str) -> None:
        part = _part_of(path)
        if part is None:
            return
        self.threads[part].add(threading.current_thread().name)
        if part == layout.OPTIM_DIR:
            self.optimizer_opened.set()
        else:
            self.model_waited_for_optimizer.append(self.optimizer_opened.wait(self._wait_s))
        if part == self._fail:
            raise OSError(f"injected: cannot read {path}")

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False) -> Iterator[BinaryIO]:
        self._gate(path)
        with self.inner.open_sequential(path, direct) as f:
            yield f

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        self._gate(path)
        with self.inner.open_read(path) as f:
            yield f

    def read_buffer(self, path: str, allocate: Any = None) -> Any:
        self._gate(path)
        return self.inner.read_buffer(path, allocate)


def _saved(tmp_path, use_xser: bool) -> tuple[str, dict, dict]:
    gen = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.rand(256, 256, generator=gen) for i in range(3)}
    optimizer = {
        "state": {i: {"exp_avg": torch.rand(256, 256, generator=gen)} for i in range(3)},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
    }
    nxd.save_checkpoint(str(tmp_path), "t", model=model, optimizer=optimizer, use_xser=use_xser)
    nxd.finalize_checkpoint()
    return str(tmp_path), model, optimizer


@pytest.mark.parametrize("use_xser", [False, True])
def test_the_optimizer_is_read_while_the_model_is_and_both_load_exactly(tmp_path, use_xser):
    path, model, optimizer = _saved(tmp_path, use_xser)
    storage = _Gated(LocalStorage(path))
    live = {k: torch.zeros_like(v) for k, v in model.items()}
    loaded_optimizer: dict = {}
    nxd.load_checkpoint(storage, "t", model=live, optimizer=loaded_optimizer)
    assert storage.model_waited_for_optimizer and all(storage.model_waited_for_optimizer)  # not one after the other
    assert not storage.threads[layout.MODEL_DIR] & {n for n in storage.threads[layout.OPTIM_DIR]
                                                      if n.startswith("nxd_ckpt_optimizer_read")}  # fmt: skip
    assert all(torch.equal(live[k], model[k]) for k in model)
    assert all(torch.equal(loaded_optimizer["state"][i]["exp_avg"], optimizer["state"][i]["exp_avg"]) for i in range(3))


@pytest.mark.parametrize("failing", [layout.MODEL_DIR, layout.OPTIM_DIR])
def test_a_failed_read_of_either_is_raised_and_no_reading_thread_is_left(tmp_path, failing):
    path, model, _ = _saved(tmp_path, use_xser=False)
    storage = _Gated(LocalStorage(path), wait_s=0.5, fail=failing)
    before = {t for t in threading.enumerate() if t.name.startswith("nxd_ckpt_optimizer_read")}
    with pytest.raises((CheckpointError, OSError), match="injected"):
        nxd.load_checkpoint(storage, "t", model={k: torch.zeros_like(v) for k, v in model.items()}, optimizer={})
    left = {t for t in threading.enumerate() if t.name.startswith("nxd_ckpt_optimizer_read")} - before
    for t in left:  # an idle pool thread may still be exiting; none may still be reading
        t.join(timeout=5)
        assert not t.is_alive()


@pytest.mark.xla
def test_a_load_onto_the_device_reads_one_after_the_other(tmp_path):
    """Device targets stage through host buffers of their own: one set at a time, so no read-ahead thread."""
    pytest.importorskip("torch_xla", reason="needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla)")
    import torch_xla

    path, model, _ = _saved(tmp_path, use_xser=True)
    storage = _Gated(LocalStorage(path), wait_s=0.2)
    device = torch_xla.device()
    live = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in model.items()}).to(device)
    nxd.load_checkpoint(storage, "t", model=live, optimizer={})
    assert not any(n.startswith("nxd_ckpt_optimizer_read") for n in storage.threads[layout.OPTIM_DIR])
    assert all(torch.equal(live[k].cpu(), model[k]) for k in model)
