"""xxh3_64 digests of checkpoint files, computed without holding the GIL where possible.

The ``xxhash`` package holds the GIL while it hashes, so the I/O threads of a rank serialize on it (about
0.05-0.1 s per GiB each). Its extension module also exports xxHash's C functions; called through ``ctypes``,
which releases the GIL around foreign calls, the same hash runs in parallel with the other threads. Digests are
identical either way (``tests/unit/format/test_hashing.py``); without the exported symbols the package's own API
is used.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import xxhash


@functools.cache
def _native() -> Any:
    """xxHash's C API from the ``xxhash`` extension module, or None when it is not exported."""
    try:
        from xxhash import _xxhash

        lib = ctypes.CDLL(_xxhash.__file__)
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        # The x86 build also exports the update that picks AVX2/AVX-512 at run time (what the package's own
        # objects use): measured 1.7x the speed of the plain symbol on our VMs. Either gives the same digest.
        update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.nxd_update = update
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        oneshot = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits  # the same choice as ``update``
        oneshot.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        oneshot.restype = ctypes.c_uint64
        lib.nxd_oneshot = oneshot
        sample = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)  # 1 MiB: long enough for the vector loop
        probe = _NativeHasher(lib)
        probe.update(sample)
        expected = xxhash.xxh3_64_hexdigest(sample.tobytes())
        if probe.hexdigest() != expected or _oneshot(lib, sample) != expected:
            return None
        return lib
    except (ImportError, OSError, AttributeError):
        return None


class _NativeHasher:
    """An xxh3_64 state in C memory; ``update`` of large buffers runs without the GIL."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._state = lib.XXH3_createState()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        lib.XXH3_64bits_reset(self._state)

    def update(self, data: Any) -> None:
        array = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
        if array.nbytes:
            self._lib.nxd_update(self._state, array.__array_interface__["data"][0], array.nbytes)

    def hexdigest(self) -> str:
        return f"{self._lib.XXH3_64bits_digest(self._state):016x}"

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._lib.XXH3_freeState(state)


class Hasher:
    """Incremental xxh3_64 (the digest ``xxhash.xxh3_64().hexdigest()`` gives) that hashes large pieces
    off the GIL when it can."""

    def __init__(self) -> None:
        lib = _native()
        self._impl: Any = _NativeHasher(lib) if lib is not None else xxhash.xxh3_64()
        self._native = lib is not None

    def update(self, data: Any) -> None:
        self._impl.update(data)

    def hexdigest(self) -> str:
        return self._impl.hexdigest()


def _oneshot(lib: Any, array: np.ndarray) -> str:
    """xxh3_64 of a whole uint8 array in one C call (no state to make and free), without the GIL."""
    return f"{lib.nxd_oneshot(array.__array_interface__['data'][0] if array.nbytes else None, array.nbytes):016x}"


def hash_bytes(data: Any) -> tuple[int, str]:
    """(size, xxh3_64 hex digest) of a buffer: one C call where the native API is there (a block check's cost is
    the hash itself, not Python around it)."""
    lib = _native()
    if lib is not None:
        array = data.reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        if array.dtype == np.uint8 or array.nbytes == 0:
            return array.nbytes, _oneshot(lib, array)
    hasher = Hasher()
    hasher.update(data)
    return memoryview(data).nbytes, hasher.hexdigest()
