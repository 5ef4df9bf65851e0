"""Reading parts of a stored file: a seekable stream over ``Storage.read_bytes`` ranges where the backend fetches
ranges cheaply (S3), the file itself elsewhere."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from nxd_ckpt.storage.base import Storage

__all__ = ["PartialReadStream", "RangeReader", "open_for_partial_reads"]


class RangeReader(io.RawIOBase):
    """A seekable read-only stream over ``Storage.read_bytes`` ranges (S3 range GETs), so unpickling a file's
    structure reads its zip directory and ``data.pkl`` only, never the whole object."""

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage, self._path = storage, path
        self._size = storage.size(path)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        data = self._storage.read_bytes(self._path, self._pos, n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass
class PartialReadStream:
    """Context manager giving the cheapest seekable stream of a file for partial reads."""

    storage: Storage
    path: str
    _cm: Any = field(default=None, repr=False)

    def __enter__(self) -> Any:
        if not self.storage.ranged_reads:
            self._cm = self.storage.open_read(self.path)
            return self._cm.__enter__()
        return RangeReader(self.storage, self.path)  # unbuffered: torch reads ~20 small ranges, not the data

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


def open_for_partial_reads(storage: Storage, path: str) -> PartialReadStream:
    """A seekable stream of one file for reading parts of it: the file itself on local disk, else ranged reads."""
    return PartialReadStream(storage, path)
