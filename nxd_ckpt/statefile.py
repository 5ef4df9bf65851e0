"""One state file on storage, in either encoding: plain ``torch.save`` or xser (one file per tensor)."""

from __future__ import annotations

from typing import Any

from . import layout
from .serialization import plain
from .storage import Storage


def is_xser_file(storage: Storage, path: str) -> bool:
    """A state file is xser when its ``<path>.tensors`` directory exists."""
    return bool(storage.list_dir(layout.xser_tensors_dir(path)))


def write_plain(storage: Storage, path: str, state: Any) -> list[str]:
    """Write ``state`` (host tensors) as one ``torch.save`` file; return the paths written."""
    with storage.open_write(path) as f:
        plain.save(state, f)
    return [path]


def read_plain(storage: Storage, path: str, *, trusted: bool = False) -> Any:
    with storage.open_read(path) as f:
        return plain.load(f, what=f"{storage.url}/{path}", trusted=trusted)
