"""Fresh tensors of a load are faulted in on a background thread, ahead of the reader, without changing a byte."""

from __future__ import annotations

import time

import pytest
import torch

import nxd_ckpt as nxd
from harness.residency import MincoreUnavailable, resident_fraction
from nxd_ckpt import pages


def _resident_fraction(t: torch.Tensor) -> float:
    try:
        return resident_fraction(t)
    except MincoreUnavailable as e:
        pytest.skip(str(e))


def _populate_supported() -> bool:
    probe = torch.empty(4 << 20, dtype=torch.uint8)
    return pages.populate(probe.data_ptr(), probe.data_ptr() + probe.numel())


def _wait_resident(t: torch.Tensor, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (fraction := _resident_fraction(t)) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return fraction


def test_the_prefaulter_brings_fresh_pages_in_before_anyone_touches_them() -> None:
    if not _populate_supported():
        pytest.skip("this kernel has no madvise(MADV_POPULATE_WRITE)")
    fresh = torch.empty(64 << 20, dtype=torch.uint8)  # large: its own mapping, no page touched yet
    if _resident_fraction(fresh) > 0.5:
        pytest.skip("the allocator handed out memory that was already touched")
    prefaulter = pages.Prefaulter([fresh])
    try:
        assert _wait_resident(fresh) == 1.0
    finally:
        prefaulter.close()


def test_populating_never_changes_bytes_already_written() -> None:
    """The reader fills pages while the thread populates them: the bytes it wrote must stay."""
    t = torch.empty(16 << 20, dtype=torch.uint8)
    t[: 8 << 20] = torch.arange(8 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
    before = t[: 8 << 20].clone()
    with pages.prefaulted([t]):
        pass
    pages.populate(t.data_ptr(), t.data_ptr() + t.numel())  # all of it, whether or not the thread got there
    assert torch.equal(t[: 8 << 20], before)


def test_close_stops_the_thread_and_small_or_no_tensors_start_none() -> None:
    assert pages.Prefaulter([])._thread is None
    assert pages.Prefaulter([torch.empty(16, dtype=torch.uint8)])._thread is None
    big = [torch.empty(32 << 20, dtype=torch.uint8) for _ in range(4)]
    prefaulter = pages.Prefaulter(big)
    prefaulter.close()
    assert prefaulter._thread is None or not prefaulter._thread.is_alive()


def test_without_kernel_support_nothing_is_started_and_loads_are_unchanged(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pages, "_supported", False)
    assert pages.Prefaulter([torch.empty(8 << 20, dtype=torch.uint8)])._thread is None
    model = {"w": torch.randn(512, 1024), "b": torch.randn(7)}
    nxd.save_checkpoint(str(tmp_path), "t", model=model)
    into: dict = {}
    nxd.load_checkpoint(str(tmp_path), "t", model=into)
    assert set(into) == set(model) and all(torch.equal(into[k], v) for k, v in model.items())


@pytest.mark.parametrize("use_xser", [False, True])
def test_a_fresh_dict_load_prefaults_the_tensors_it_returns(tmp_path, monkeypatch, use_xser: bool) -> None:
    """Plain and xser loads into fresh dicts allocate their tensors before reading and hand every large one to
    the prefaulter; the tensors returned are exactly those (bit-exact with what was saved)."""
    handed: list[torch.Tensor] = []
    real = pages.Prefaulter.__init__

    def recording(self, tensors):  # type: ignore[no-untyped-def]
        handed.extend(tensors)
        real(self, tensors)

    monkeypatch.setattr(pages.Prefaulter, "__init__", recording)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(1024, 512, generator=gen) for i in range(3)}
    model["bias"] = torch.randn(3, generator=gen)
    nxd.save_checkpoint(str(tmp_path), "t", model=model, use_xser=use_xser)
    handed.clear()
    into: dict = {}
    nxd.load_checkpoint(str(tmp_path), "t", model=into)
    assert set(into) == set(model)
    for key, saved in model.items():
        assert torch.equal(into[key], saved), key
    handed_ptrs = {t.untyped_storage().data_ptr() for t in handed}
    for key in (k for k in model if k != "bias"):
        assert into[key].untyped_storage().data_ptr() in handed_ptrs, key


def test_a_huge_buffer_is_fresh_writable_memory_of_its_size():
    """Small: from the heap; large: a mapping of its own (2 MiB pages where the kernel grants them), alive while
    a view of it is."""
    import numpy as np

    for nbytes in (10, pages.HUGE_PAGE - 1, 3 * pages.HUGE_PAGE + 5):
        buffer = pages.huge_buffer(nbytes)
        assert buffer.dtype == np.uint8 and buffer.shape == (nbytes,) and buffer.flags.writeable
        view = buffer[-4:]
        del buffer
        view[:] = 7  # still mapped
        assert view.tolist() == [7, 7, 7, 7]
