"""A read-only view of one tag held in the memory tier: each rank's files come from a chosen node's copy.

The load reads a memory-tier tag through ``TierView`` exactly as it reads a checkpoint directory: the tag's
files are those its manifests list (plus the manifests), each read from the copy of its writer's share that
the restore chose, in this node's memory directory or fetched from another node's file server. ``done`` is
answered for the tag because the restore only builds a view over a tag whose every rank part has a marker; the
load's ``VerifyingStorage`` then checks every file against the manifests, so a damaged copy raises
IntegrityError and the restore moves on to the next tier.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from nxd_ckpt.errors import FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.format.manifests import parse_manifest
from nxd_ckpt.serialization.inmemory import BufferReader
from nxd_ckpt.storage import LocalStorage, Storage
from nxd_ckpt.storage.base import Allocator
from nxd_ckpt.tier.transport import FileClient, MissingOnPeer

SMALL_FILE_BYTES = 1 << 20
"""Files up to this size that the restore reads whole are kept by the view (see ``TierView._small``)."""


@dataclass(frozen=True)
class Source:
    """Where one writer rank's files are read: a share directory on this node, or a peer's file server."""

    share: int
    local_root: str | None = None
    """This node's memory root when the copy is here."""
    address: str | None = None
    """``host:port`` of a file server on the node holding the copy."""

    @property
    def remote(self) -> bool:
        return self.local_root is None


class TierView(Storage):
    """Read access to ``tag`` assembled from the sources of every writer rank (``sources[q]``)."""

    def __init__(self, url: str, tag: str, sources: dict[int, Source], client: FileClient) -> None:
        self.url = url
        self.tag = layout.validate_tag(tag)
        self._sources = sources
        self._client = client
        self._owner: dict[str, int] | None = None
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._small: dict[str, bytes] = {}
        """Small files already read whole (manifests, metadata): a restore reads them on several steps, and a
        peer's copy would cost a round trip each time. The view's files do not change while it is in use."""
        self.bytes_local = 0
        self.bytes_remote = 0

    # ------------------------------------------------------------------ where each file is
    def _share_path(self, path: str, rank: int) -> str:
        return f"{layout.memory_share_dir(self._sources[rank].share)}/{path}"

    def _fetch(self, rank: int, path: str, allocate: Allocator | None = None) -> np.ndarray:
        source = self._sources[rank]
        if source.remote:
            assert source.address is not None
            data = self._client.get(source.address, self._share_path(path, rank), allocate)
            with self._lock:
                self.bytes_remote += data.nbytes
            return data
        assert source.local_root is not None
        data = LocalStorage(source.local_root).read_buffer(self._share_path(path, rank), allocate)
        with self._lock:
            self.bytes_local += data.nbytes
        return data

    def owners(self) -> dict[str, int]:
        """Every file of the tag (path within the checkpoint directory) -> the rank whose manifest lists it."""
        with self._lock:
            if self._owner is not None:
                return self._owner
        owner: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for rank in sorted(self._sources):
            path = layout.manifest_file(self.tag, rank)
            try:
                data = self._fetch(rank, path).tobytes()
            except (FileNotFoundError, MissingOnPeer) as e:
                raise FormatError(
                    f"the memory-tier copy of rank {rank}'s manifest of {self.tag} is missing: {e}"
                ) from e
            _, records = parse_manifest(data, f"{self.url}/{path}")
            self._keep_small(path, data)
            owner[path], sizes[path] = rank, len(data)
            for rel, rec in records.items():
                owner[f"{self.tag}/{rel}"], sizes[f"{self.tag}/{rel}"] = rank, rec.size
        with self._lock:
            self._owner, self._sizes = owner, sizes
        return owner

    def _owner_of(self, path: str) -> int | None:
        return self.owners().get(path)

    # ------------------------------------------------------------------ Storage, read side
    def read_buffer(self, path: str, allocate: Allocator | None = None) -> np.ndarray:
        rank = self._owner_of(path)
        if rank is None:
            if path == layout.tag_path(self.tag, layout.DONE_MARKER):
                return np.frombuffer(bytearray(b"1"), dtype=np.uint8)
            raise FileNotFoundError(f"{self.url}/{path} is not part of the memory-tier copy of {self.tag}")
        try:
            return self._fetch(rank, path, allocate)
        except (FileNotFoundError, MissingOnPeer) as e:
            raise FormatError(f"memory-tier file {self.url}/{path} is missing: {e}") from e

    def _source_of(self, path: str) -> tuple[int, Source]:
        rank = self._owner_of(path)
        if rank is None:
            raise FileNotFoundError(f"{self.url}/{path} is not part of the memory-tier copy of {self.tag}")
        return rank, self._sources[rank]

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        """A local copy is read in place (no copy in between); a peer's is fetched whole, then read from memory."""
        if path == layout.tag_path(self.tag, layout.DONE_MARKER):
            yield io.BytesIO(b"1")
            return
        rank, source = self._source_of(path)
        if source.remote:
            yield BufferReader(self.read_buffer(path))  # type: ignore[misc]
            return
        assert source.local_root is not None
        full = os.path.join(source.local_root, self._share_path(path, rank))
        try:
            f = open(full, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError as e:
            raise FormatError(f"memory-tier file {self.url}/{path} is missing: {e}") from e
        with f:
            with self._lock:
                self.bytes_local += os.fstat(f.fileno()).st_size
            yield f

    @contextlib.contextmanager
    def open_sequential(self, path: str, direct: bool = False) -> Iterator[BinaryIO]:
        """Read once, front to back: a peer's file streams from the socket into the caller's buffers."""
        if path == layout.tag_path(self.tag, layout.DONE_MARKER):
            yield io.BytesIO(b"1")
            return
        rank, source = self._source_of(path)
        if not source.remote:
            with self.open_read(path) as f:
                yield f
            return
        assert source.address is not None
        try:
            with self._client.open_stream(source.address, self._share_path(path, rank)) as stream:
                with self._lock:
                    self.bytes_remote += stream.size
                yield stream  # type: ignore[misc]
        except MissingOnPeer as e:
            raise FormatError(f"memory-tier file {self.url}/{path} is missing: {e}") from e

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with self._lock:
            data = self._small.get(path)
        if data is None:
            data = self.read_buffer(path).tobytes()
            self._keep_small(path, data)
        return data[offset:] if length is None else data[offset : offset + length]

    def _keep_small(self, path: str, data: bytes) -> None:
        if len(data) <= SMALL_FILE_BYTES:
            with self._lock:
                self._small[path] = data

    def exists(self, path: str) -> bool:
        if path in ("", self.tag) or path == layout.tag_path(self.tag, layout.DONE_MARKER):
            return True
        if path == layout.tag_path(self.tag, layout.CHECKPOINT_MARKER):
            return False
        owners = self.owners()
        return path in owners or any(p.startswith(path + "/") for p in owners)

    def list_dir(self, path: str = "") -> list[str]:
        if path == "":
            return [self.tag]
        names = {p[len(path) + 1 :].split("/", 1)[0] for p in self.owners() if p.startswith(path + "/")}
        if path == self.tag:
            names.add(layout.DONE_MARKER)
        return sorted(names)

    def size(self, path: str) -> int:
        """The size its manifest records (the read that follows checks it)."""
        self.owners()
        if path not in self._sizes:
            raise FileNotFoundError(f"{self.url}/{path} is not part of the memory-tier copy of {self.tag}")
        return self._sizes[path]

    def mtime(self, path: str) -> float:
        return 0.0

    # ------------------------------------------------------------------ no writes
    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        raise PermissionError(f"the memory-tier view of {self.tag} is read-only")

    def delete(self, path: str) -> None:
        raise PermissionError(f"the memory-tier view of {self.tag} is read-only")

    def delete_tree(self, path: str) -> None:
        raise PermissionError(f"the memory-tier view of {self.tag} is read-only")
