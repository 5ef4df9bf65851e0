"""Pinned host buffers made by locking pageable memory in place (``pinned.registered_empty``, CUDA's
``cudaHostRegister``), with the registration calls recorded by a fake: what is registered, and that a range is
unregistered exactly once, after the last tensor over it is gone and before its memory is freed."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

from harness.mappings import mapping_at
from nxd_ckpt.device import backend
from nxd_ckpt.device.pinned import PAGE, REGISTER_MIN_BYTES, registered_empty


class FakeRegistry:
    """Records registered ranges like the driver: a page registered twice is an error."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.ranges: dict[int, int] = {}
        self.registered = 0
        self.unregistered: list[int] = []

    def register(self, address: int, length: int) -> bool:
        if self.refuse:
            return False
        assert address % PAGE == 0 and length % PAGE == 0 and length > 0
        for start, size in self.ranges.items():
            assert address + length <= start or start + size <= address, "two buffers share a registered page"
        self.ranges[address] = length
        self.registered += 1
        return True

    def unregister(self, address: int) -> None:
        assert address in self.ranges, "unregistered a range never registered (or twice)"
        del self.ranges[address]
        self.unregistered.append(address)


def test_a_registered_buffer_has_the_shape_and_lies_in_its_range_on_whole_pages():
    registry = FakeRegistry()
    t = registered_empty((3, 1000), torch.float32, registry.register, registry.unregister)
    assert t is not None and t.shape == (3, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    ((address, length),) = registry.ranges.items()
    assert address <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= address + length
    t.copy_(torch.arange(3000.0).view(3, 1000))
    assert torch.equal(t.flatten(), torch.arange(3000.0))


def test_neighbouring_buffers_never_share_a_registered_page():
    registry = FakeRegistry()
    buffers = [registered_empty((n,), torch.uint8, registry.register, registry.unregister) for n in range(1, 200, 7)]
    assert all(b is not None for b in buffers) and registry.registered == len(buffers)


def test_the_range_is_unregistered_once_after_the_last_tensor_over_it_is_gone():
    registry = FakeRegistry()
    t = registered_empty((4096,), torch.float32, registry.register, registry.unregister)
    view = t[100:200].view(torch.int32)
    del t
    gc.collect()
    assert registry.unregistered == [], "unregistered while a view was still in use"
    del view
    gc.collect()
    assert len(registry.unregistered) == 1 and registry.ranges == {}


def test_a_refused_registration_gives_none_and_nothing_to_unregister():
    registry = FakeRegistry(refuse=True)
    assert registered_empty((4096,), torch.float32, registry.register, registry.unregister) is None
    assert registered_empty((0,), torch.float32, FakeRegistry().register, registry.unregister) is None
    gc.collect()
    assert registry.unregistered == []


class FakeCudaDevice:
    """``torch.cuda.device`` for a CPU build: each thread's current device (0 until set), as the runtime keeps it."""

    current = threading.local()

    def __init__(self, index: int) -> None:
        self.index = index

    @classmethod
    def now(cls) -> int:
        return getattr(cls.current, "index", 0)

    def __enter__(self) -> None:
        self.previous = self.now()
        FakeCudaDevice.current.index = self.index

    def __exit__(self, *exc: object) -> None:
        FakeCudaDevice.current.index = self.previous


class FakeCudart:
    """Registration calls recorded with the calling thread's current device (where the runtime would use a
    context)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.registry = FakeRegistry()
        self.devices: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        assert flags == 0
        self.devices.append(("register", FakeCudaDevice.now()))
        return self.error if self.error else (0 if self.registry.register(address, length) else 1)

    def cudaHostUnregister(self, address: int) -> int:
        self.devices.append(("unregister", FakeCudaDevice.now()))
        self.registry.unregister(address)
        return 0


@pytest.fixture
def cuda_pinned(monkeypatch: pytest.MonkeyPatch):
    """``NativeDevice("cuda", index).staging_empty`` with a fake cudart and ``torch.cuda.device``, torch's pinned
    allocator recorded, and the devices the error path launches on (``torch.zeros``)."""
    from_allocator: list[tuple[int, ...]] = []
    launches: list[torch.device] = []
    real_empty, real_zeros = torch.empty, torch.zeros

    def empty(*args, **kwargs):
        if kwargs.pop("pin_memory", False):
            from_allocator.append(tuple(args[0]))
        return real_empty(*args, **kwargs)

    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            launches.append(torch.device(device))
            raise RuntimeError("CUDA error: invalid argument (the error the failed registration left)")
        return real_zeros(*args, device=device, **kwargs)

    monkeypatch.setattr(backend, "_CUDA_REGISTER_FAILED", [])

    def make(error: int, index: int = 0) -> tuple[backend.NativeDevice, FakeCudart, list, list]:
        cudart = FakeCudart(error)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(torch.cuda, "device", FakeCudaDevice)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "zeros", zeros)
        return backend.NativeDevice(torch.device("cuda", index)), cudart, from_allocator, launches

    return make


def test_cuda_staging_buffers_of_a_mib_or_more_are_locked_in_place_others_come_from_torch(cuda_pinned):
    device, cudart, from_allocator, _ = cuda_pinned(0)
    big = device.staging_empty((REGISTER_MIN_BYTES // 4,), torch.float32)
    small = device.staging_empty((16,), torch.float32)
    assert big.shape == (REGISTER_MIN_BYTES // 4,) and cudart.registry.registered == 1
    assert from_allocator == [(16,)] and small.shape == (16,)
    load_arena = device.pinned_empty((REGISTER_MIN_BYTES,), torch.uint8)  # host -> device copies: the allocator's
    assert from_allocator[-1] == (REGISTER_MIN_BYTES,) and cudart.registry.registered == 1
    del load_arena
    del big
    gc.collect()
    assert cudart.registry.ranges == {}


def test_after_a_failed_registration_every_buffer_comes_from_torchs_pinned_allocator(cuda_pinned):
    device, _cudart, from_allocator, _ = cuda_pinned(712)  # cudaErrorHostMemoryAlreadyRegistered
    device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8)
    device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8)
    assert from_allocator == [(REGISTER_MIN_BYTES,), (REGISTER_MIN_BYTES,)]
    assert backend._CUDA_REGISTER_FAILED == ["cudaHostRegister returned error 712"]


def _on_new_thread(fn):
    """``fn()``'s result, run on a new thread (which starts on device 0, as a CUDA thread does)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(timeout=30)
    assert out, "the thread failed"
    return out[0]


def test_cuda_registration_unregistration_and_the_error_path_run_under_the_buffers_device_on_any_thread(cuda_pinned):
    device, cudart, _, _ = cuda_pinned(0, index=1)
    big = _on_new_thread(lambda: device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8))
    holder = [big]
    del big
    _on_new_thread(lambda: holder.clear() or gc.collect())  # the last tensor over it dropped on another new thread
    assert cudart.devices == [("register", 1), ("unregister", 1)] and cudart.registry.ranges == {}
    device, cudart, from_allocator, launches = cuda_pinned(712, index=1)  # cudaErrorHostMemoryAlreadyRegistered
    _on_new_thread(lambda: device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8))
    assert cudart.devices == [("register", 1)], "cudaHostRegister ran on another device than the buffer's"
    assert launches == [torch.device("cuda", 1)], "the launch that takes the registration's error ran elsewhere"
    assert from_allocator == [(REGISTER_MIN_BYTES,)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_a_registered_buffer_is_a_mapping_of_its_own_not_forked_and_dropping_it_unregisters_then_unmaps():
    still_mapped_at_unregister: list[bool] = []
    registry = FakeRegistry()

    def unregister(address: int) -> None:
        still_mapped_at_unregister.append(mapping_at(address) is not None)
        registry.unregister(address)

    t = registered_empty((3 * PAGE + 5,), torch.uint8, registry.register, unregister)
    assert t is not None
    ((address, length),) = registry.ranges.items()
    mapping = mapping_at(address)
    assert mapping is not None and mapping.start <= address and address + length <= mapping.end
    assert "dc" in mapping.flags, "a forked child would inherit the registered range (no MADV_DONTFORK)"
    del t
    gc.collect()
    assert still_mapped_at_unregister == [True], "unmapped before it was unregistered"
    assert mapping_at(address) is None, "the dropped buffer is still mapped"
