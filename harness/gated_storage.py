"""Local storage whose writes a test holds back: a save still being written, for as long as the test needs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import BinaryIO

from nxd_ckpt.storage import LocalStorage


class GatedStorage(LocalStorage):
    """Local storage whose model-file writes wait for ``gate``: a save still being written, for as long as a test
    needs (the wait gives up after ``timeout_s``, failing the write instead of hanging the test)."""

    def __init__(self, root: str, gate: threading.Event, timeout_s: float = 60.0) -> None:
        super().__init__(root)
        self.gate = gate
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        if "/model/" in path and not self.gate.wait(self.timeout_s):
            raise TimeoutError(f"GatedStorage: the gate of {path} stayed closed for {self.timeout_s} s")
        with super().open_write(path) as f:
            yield f
