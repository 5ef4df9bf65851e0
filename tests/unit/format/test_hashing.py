"""hashing.py: the same xxh3_64 digests as the xxhash package, incremental or whole, GIL-free or not."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import xxhash

from nxd_ckpt.format import hashing

SIZES = [0, 1, 7, 64 << 10, (1 << 20) + 3]


@pytest.mark.parametrize("size", SIZES)
def test_digests_match_the_xxhash_package(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    expected = xxhash.xxh3_64_hexdigest(data.tobytes())
    assert hashing.hash_bytes(data) == (size, expected)
    assert hashing.hash_bytes(data.tobytes()) == (size, expected)
    assert hashing.hash_bytes(memoryview(data.tobytes())) == (size, expected)
    pieces = hashing.Hasher()
    for start in range(0, size, 100_003):  # incremental, in pieces of odd sizes
        pieces.update(memoryview(data)[start : start + 100_003])
    assert pieces.hexdigest() == expected


def test_any_buffer_hashes_as_its_bytes():
    t = torch.arange(1000, dtype=torch.bfloat16)
    raw = t.view(torch.uint8).numpy().tobytes()
    assert hashing.hash_bytes(t.view(torch.uint8).numpy())[1] == xxhash.xxh3_64_hexdigest(raw)
    assert hashing.hash_bytes(memoryview(bytearray(raw)).cast("H"))[1] == xxhash.xxh3_64_hexdigest(raw)


def test_native_path_is_used_when_the_extension_exports_it_and_threads_agree():
    if hashing._native() is None:
        pytest.skip("this xxhash build does not export its C API: the package's own API is used")
    assert isinstance(hashing.Hasher()._impl, hashing._NativeHasher)
    data = [np.random.default_rng(i).integers(0, 256, 3 << 20, dtype=np.uint8) for i in range(4)]
    results: dict[int, str] = {}

    def work(i: int) -> None:
        results[i] = hashing.hash_bytes(data[i])[1]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: xxhash.xxh3_64_hexdigest(d.tobytes()) for i, d in enumerate(data)}


def test_falls_back_to_the_package_api(monkeypatch):
    monkeypatch.setattr(hashing, "_native", lambda: None)
    hasher = hashing.Hasher()
    hasher.update(b"abc")
    assert hasher.hexdigest() == xxhash.xxh3_64_hexdigest(b"abc")


def test_native_path_hashes_with_the_run_time_dispatched_update_when_exported():
    """The plain exported update is the build's baseline code (about 0.6x the speed); the dispatched one
    picks the CPU's vector unit, as the package's own objects do. Same digests (test above)."""
    lib = hashing._native()
    if lib is None or not hasattr(lib, "XXH3_64bits_update_dispatch"):
        pytest.skip("this xxhash build exports no dispatched update")
    assert lib.nxd_update is lib.XXH3_64bits_update_dispatch
