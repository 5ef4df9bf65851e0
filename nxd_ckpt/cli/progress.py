"""Progress bars of the long commands (verify, export, reshard): on stderr, only when it is a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from nxd_ckpt.storage import DelegatingStorage, Storage
from nxd_ckpt.storage.base import CountingStream


class _NoProgress:
    """The bar when none is shown: ignores updates."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr when it is a terminal (and not disabled), else an object that ignores updates."""
    if not enabled or not sys.stderr.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)


class ReadProgressStorage(DelegatingStorage):
    """Delegates to another storage and reports every byte read (drives the progress bar of ``verify``)."""

    def __init__(self, inner: Storage, report: Callable[[int], Any]) -> None:
        super().__init__(inner)
        self._report = report

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_read(path) as f:
            yield CountingStream(f, self._report)  # type: ignore[misc]

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        self._report(len(data))
        return data

    read_buffer = Storage.read_buffer  # through open_read above, so whole-file reads are counted too

    def local_path(self, path: str) -> str | None:
        return None  # every read goes through this wrapper, to be counted
