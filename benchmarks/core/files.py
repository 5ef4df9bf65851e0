"""Files the way a benchmark needs them: durable writes of the baselines (fsync), removal, and a cold page cache
before loads (``drop_caches`` as root, else marked warm, or evicted file by file)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Any

from nxd_ckpt.storage.local import fsync_path

CHUNK = 64 << 20
"""Bytes per write of the disk baselines."""


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (for writers that do not make their files durable)."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def torch_save_fsynced(obj: Any, path: str, directory: bool = False) -> None:
    """``torch.save`` to ``path``, durable on return (with ``directory``, its directory entry too)."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if directory:
        fsync_path(os.path.dirname(path) or ".")


def write_fsynced(path: str, tensors: list[Any]) -> None:
    """The tensors' bytes written to one file in 64 MiB pieces, then fsync (file and directory)."""
    import torch

    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for offset in range(0, len(view), CHUNK):
                piece = view[offset : offset + CHUNK]
                while piece:
                    piece = piece[f.write(piece) :]
        os.fsync(f.fileno())
    fsync_path(os.path.dirname(path))


def remove(path: str) -> None:
    """Remove a file or a directory tree; a missing one is fine."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def drop_caches() -> tuple[bool, str]:
    """Drop the page cache (root only): (done, why not)."""
    if os.geteuid() != 0:
        return False, "not root"
    done = subprocess.run(
        ["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], capture_output=True, text=True, check=False
    )
    return (True, "") if done.returncode == 0 else (False, done.stderr.strip() or f"rc {done.returncode}")


def read_through(root: str) -> int:
    """Read every file under ``root`` once, so that all of it is in the page cache (files written with O_DIRECT,
    as nxd's writer writes them, never enter it otherwise: a "warm" load of them would read the disk while the
    other paths' buffered writes are cached); returns the bytes read."""
    total = 0
    buffer = bytearray(8 << 20)
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    total += n
    return total


def evict(root: str) -> str:
    """Evict ``root``'s files from the page cache, by ``drop_caches`` where allowed, else file by file
    (``posix_fadvise(DONTNEED)`` after ``fdatasync``); returns how."""
    if drop_caches()[0]:
        return "drop_caches"
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) per file"


class PageCache:
    """Drops the page cache before cold loads when this process may (root, writable drop_caches); ``cold`` says
    whether the loads so far were, ``why`` why not."""

    def __init__(self, warm: bool) -> None:
        self.cold, self.why = False, "--warm given"
        if not warm:
            self.cold, self.why = drop_caches()

    def drop(self) -> None:
        """Drop it again before a load; once that fails, later loads are warm (and said so)."""
        if self.cold:
            self.cold, self.why = drop_caches()
            if not self.cold:
                print(f"page cache: could not drop it any more ({self.why}); later loads are WARM", flush=True)
