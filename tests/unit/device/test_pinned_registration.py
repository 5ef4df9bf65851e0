"""Pinned host buffers made by locking pageable memory in place (``pinned.registered_empty``, CUDA's
``cudaHostRegister``), with the registration calls recorded by a fake: what is registered, and that a range is
unregistered exactly once, after the last tensor over it is gone and before its memory is freed."""

from __future__ import annotations

import gc

import pytest
import torch

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


class FakeCudart:
    def __init__(self, error: int) -> None:
        self.error = error
        self.registry = FakeRegistry()

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        assert flags == 0
        return self.error if self.error else (0 if self.registry.register(address, length) else 1)

    def cudaHostUnregister(self, address: int) -> int:
        self.registry.unregister(address)
        return 0


@pytest.fixture
def cuda_pinned(monkeypatch: pytest.MonkeyPatch):
    """``NativeDevice("cuda").staging_empty`` with a fake cudart, and torch's pinned allocator recorded."""
    from_allocator: list[tuple[int, ...]] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.pop("pin_memory", False):
            from_allocator.append(tuple(args[0]))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(backend, "_CUDA_REGISTER_FAILED", [])

    def make(error: int) -> tuple[backend.NativeDevice, FakeCudart, list]:
        cudart = FakeCudart(error)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(torch, "empty", empty)
        return backend.NativeDevice(torch.device("cuda", 0)), cudart, from_allocator

    return make


def test_cuda_staging_buffers_of_a_mib_or_more_are_locked_in_place_others_come_from_torch(cuda_pinned):
    device, cudart, from_allocator = cuda_pinned(0)
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
    device, _cudart, from_allocator = cuda_pinned(712)  # cudaErrorHostMemoryAlreadyRegistered
    device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8)
    device.staging_empty((REGISTER_MIN_BYTES,), torch.uint8)
    assert from_allocator == [(REGISTER_MIN_BYTES,), (REGISTER_MIN_BYTES,)]
    assert backend._CUDA_REGISTER_FAILED == ["cudaHostRegister returned error 712"]
