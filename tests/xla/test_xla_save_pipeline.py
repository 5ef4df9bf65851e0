"""Synchronous saves of device state: host copies are made by a thread running ahead of the writers
(device.transfer.DeviceTransfer), only for the tensors this rank writes, and a failed transfer fails the save."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import statefile, xla
from nxd_ckpt.device.transfer import DeviceTransfer
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"
torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


def _device_state(device) -> dict:
    g = torch.Generator().manual_seed(1)
    cpu = {f"w{i}": torch.randn(128, 64 * (i + 1), generator=g) for i in range(6)}
    cpu["tiny"] = torch.tensor(3.0)
    return cpu


def test_host_copies_arrive_in_order_out_of_order_and_unplanned():
    device = torch_xla.device()
    cpu = _device_state(device)
    on_device = {k: v.to(device) * 2 for k, v in cpu.items()}  # pending graphs: the fetcher's sync runs them
    names = list(on_device)
    planned = [on_device[k] for k in names[:-2]]
    fetcher = DeviceTransfer(planned, planned, chunk_bytes=64 << 10)
    try:
        for k in reversed(names):  # asks for the last planned first, and for two tensors never planned
            got = fetcher.host(on_device[k])
            assert got.device.type == "cpu" and torch.equal(got, cpu[k] * 2), k
        plain = torch.ones(3)
        assert fetcher.host(plain) is not None and torch.equal(fetcher.host(plain), plain)
    finally:
        fetcher.close()


def test_a_failed_transfer_reaches_the_writers_and_close(monkeypatch):
    device = torch_xla.device()
    tensors = [torch.full((1024,), float(i)).to(device) for i in range(4)]
    real = xla.fetch
    calls: list[int] = []

    def first_batch_then_fail(chunk):
        calls.append(len(chunk))
        if len(calls) > 1:
            raise RuntimeError("device lost")
        return real(chunk)

    monkeypatch.setattr(xla, "fetch", first_batch_then_fail)
    fetcher = DeviceTransfer(tensors, tensors, chunk_bytes=4096)
    assert torch.equal(fetcher.host(tensors[0]), torch.zeros(1024))
    with pytest.raises(RuntimeError, match="device lost"):
        fetcher.host(tensors[3])
    fetcher.close()  # already reported to a writer: not raised twice

    calls.clear()
    fetcher = DeviceTransfer(tensors, tensors, chunk_bytes=4096)
    with pytest.raises(RuntimeError, match="device lost"):
        fetcher.close()  # nobody asked: close raises it


def test_writes_start_before_the_transfer_ends_and_the_save_is_exact(tmp_path, monkeypatch):
    """The disk does not wait for the whole state to reach the host (batches slowed down to make it visible)."""
    device = torch_xla.device()
    cpu = _device_state(device)
    model = {k: v.to(device) for k, v in cpu.items()}
    events: list[str] = []
    lock = threading.Lock()
    real_fetch = xla.fetch

    def slow_batches(chunk):
        out = real_fetch(chunk)
        time.sleep(0.05)
        with lock:
            events.append("batch")
        return out

    real_save = statefile.xser.save_tensor

    def recording_save(tensor, f):
        with lock:
            events.append("write")
        real_save(tensor, f)

    monkeypatch.setattr(xla, "fetch", slow_batches)
    monkeypatch.setattr(statefile.xser, "save_tensor", recording_save)
    monkeypatch.setenv("NXD_CKPT_XLA_TRANSFER_BATCH_BYTES", str(64 << 10))
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, use_xser=True)
    assert events.count("batch") >= 4 and "write" in events
    assert events.index("write") < len(events) - 1 - events[::-1].index("batch"), (
        events
    )  # a write before the last batch
    loaded: dict = {}
    nxd.load_checkpoint(str(tmp_path), model=loaded)
    assert_state_equal(cpu, loaded)


def test_transfers_can_stay_on_the_calling_thread(monkeypatch, tmp_path):
    device = torch_xla.device()
    cpu = _device_state(device)
    on_device = {k: v.to(device) for k, v in cpu.items()}
    threads: set[str] = set()
    real = xla.fetch

    def recording(chunk):
        threads.add(threading.current_thread().name)
        return real(chunk)

    monkeypatch.setattr(xla, "fetch", recording)
    tensors = list(on_device.values())
    fetcher = DeviceTransfer(tensors, tensors, background=False)
    assert threads == {threading.current_thread().name}
    for k, t in on_device.items():
        assert torch.equal(fetcher.host(t), cpu[k])
    fetcher.close()

    monkeypatch.setenv("NXD_CKPT_XLA_TRANSFER_THREAD", "0")
    nxd.save_checkpoint(str(tmp_path), "step_1", model=on_device, use_xser=True)
    loaded: dict = {}
    nxd.load_checkpoint(str(tmp_path), model=loaded)
    assert_state_equal(cpu, loaded)


def test_a_failed_transfer_on_the_calling_thread_fails_at_once(monkeypatch):
    device = torch_xla.device()
    tensors = [torch.full((64,), float(i)).to(device) for i in range(3)]

    def failing(chunk):
        raise RuntimeError("device lost")

    monkeypatch.setattr(xla, "fetch", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        DeviceTransfer(tensors, tensors, background=False)


def test_an_async_save_brings_device_tensors_to_the_host_in_the_order_its_writers_write_them(tmp_path, monkeypatch):
    """The snapshot travels in the writers' order (the optimizer's xser files list its state in another order than
    the state dict does): a writer never waits for a tensor a later chunk brings while arrived ones wait."""
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, 32, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()
    fetched: list[int] = []
    written: list[int] = []
    lock = threading.Lock()
    real_fetch = xla.fetch
    real_save = statefile.xser.save_tensor

    def recording_fetch(chunk):
        out = real_fetch(chunk)
        with lock:
            fetched.extend(t.data_ptr() for t in out)
        return out

    def recording_save(tensor, f):
        with lock:
            written.append(tensor.data_ptr())
        real_save(tensor, f)

    monkeypatch.setattr(xla, "fetch", recording_fetch)
    monkeypatch.setattr(statefile.xser, "save_tensor", recording_save)
    monkeypatch.setenv("NXD_CKPT_XLA_TRANSFER_BATCH_BYTES", "1")  # one tensor per chunk
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")  # every tensor in a file of its own
    monkeypatch.setenv("NXD_CKPT_IO_THREADS", "1")
    expected_model = {k: v.cpu() for k, v in model.state_dict().items()}
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, optimizer=opt, use_xser=True, async_save=True)
    nxd.finalize_checkpoint()
    from_device = set(fetched)
    assert len(from_device) == 6 * 3  # weights and biases, each with two AdamW moments
    assert [p for p in written if p in from_device] == fetched
    loaded: dict = {}
    nxd.load_checkpoint(str(tmp_path), model=loaded)
    assert_state_equal(expected_model, loaded)
