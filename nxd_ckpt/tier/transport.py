"""Moving memory-tier files between nodes: a small file server per process and its client, over plain TCP.

Replication and peer restores run on the writer thread (or inside a load), never as a collective on the
training thread: a collective from a background thread would interleave with the training thread's own on the
same group. Each process serves its node's memory directory (``FileServer``); a peer pushes a file with one
``put`` (streamed from a mapping of the file, written under a temporary name and renamed, as ``LocalStorage`` does) and
fetches one with ``get``. Every request carries the job's token (made by rank 0, shared at set-up), so a stray
connection cannot read or write the memory directory; paths are checked like every storage path. Each socket
operation has a deadline (no call waits forever).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from nxd_ckpt.errors import CheckpointTimeoutError, StorageError
from nxd_ckpt.storage import LocalStorage, check_relative_path

_MAX_HEADER = 64 << 10
_PIECE = 8 << 20
WAKE_BYTES = 1 << 20
"""A receive waiting for a piece of a file is woken once this much has arrived (``SO_RCVLOWAT``), not for every
segment: 512 MiB over loopback, sendfile to a ``MSG_WAITALL`` receive, took 0.17 s and 0.30 CPU-s (both sides)
instead of 0.24-0.29 s and 0.41-0.46 CPU-s."""


def _read_line(sock_file: Any) -> dict[str, Any]:
    line = sock_file.readline(_MAX_HEADER)
    if not line.endswith(b"\n"):
        raise StorageError("memory-tier peer closed the connection or sent a malformed header")
    return json.loads(line)


def _send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    sock.sendall(json.dumps(header).encode() + b"\n")


def _kernel_deadlines(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, with the deadline kept by the kernel (SO_SNDTIMEO/SO_RCVTIMEO: a call that makes
    no progress for ``timeout_s`` fails with EAGAIN). Python's own timeouts poll before every call, so a transfer
    wakes its thread (and takes the GIL, in a process busy with its own restore) once per socket buffer."""
    seconds = max(0.001, timeout_s)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def _send_file(sock: socket.socket, f: Any, size: int, what: str, timeout_s: float) -> None:
    """All ``size`` bytes of ``f`` through ``sock`` by ``sendfile`` (the kernel copies the file's pages into the
    socket: no mapping to set up, no copy through user space), the socket blocking with kernel deadlines
    meanwhile. A/B on the tier benchmark's peer restore (4 ranks on 2 cores, interleaved runs): sendfile 0.54-0.55
    s, 8 MiB reads + sendall 0.56-0.58 s, one sendall from a populated mapping 0.64-0.68 s."""
    _kernel_deadlines(sock, timeout_s)
    try:
        offset = 0
        while offset < size:
            try:
                sent = os.sendfile(sock.fileno(), f.fileno(), offset, size - offset)
            except BlockingIOError as e:
                raise CheckpointTimeoutError(f"{what}: the receiver took nothing for {timeout_s:g} s") from e
            if not sent:
                raise StorageError(f"{what}: the file ended after {offset} of its {size} bytes")
            offset += sent
    finally:
        sock.settimeout(timeout_s)  # what follows (the answer) has Python's deadlines again


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            request = _read_line(self.rfile)
        except Exception:
            return
        try:
            if request.get("token") != self.server.token:
                raise PermissionError("wrong token: this request is not from this job")
            op, path = request.get("op"), check_relative_path(str(request.get("path", "")))
            self.request.settimeout(self.server.timeout_s)
            if op == "get":
                self._get(path)
            elif op == "put":
                self._put(path, int(request["size"]))
            elif op == "delete":
                self.server.storage.delete(path)
                _send_header(self.request, {"ok": True})
            else:
                raise ValueError(f"unknown operation {op!r}")
        except Exception as e:
            with contextlib.suppress(OSError):
                _send_header(self.request, {"ok": False, "error": f"{type(e).__name__}: {e}"})

    def _get(self, path: str) -> None:
        full = self.server.storage.local_path(path)
        assert full is not None
        if not os.path.isfile(full):
            _send_header(self.request, {"ok": False, "missing": True, "error": f"{path} is not held here"})
            return
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _send_header(self.request, {"ok": True, "size": size})
            if size:
                _send_file(self.request, f, size, f"sending {path}", self.server.timeout_s)

    def _put(self, path: str, size: int) -> None:
        remaining = size
        with self.server.storage.open_write(path) as f:
            while remaining:
                data = self.rfile.read(min(_PIECE, remaining))
                if not data:
                    raise StorageError(f"the sender of {path} stopped after {size - remaining} of {size} bytes")
                f.write(data)
                remaining -= len(data)
        _send_header(self.request, {"ok": True})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: every local rank's writer threads may connect at once (default 5)

    def __init__(self, address: tuple[str, int], storage: LocalStorage, token: str, timeout_s: float) -> None:
        super().__init__(address, _Handler)
        self.storage = storage
        self.token = token
        self.timeout_s = timeout_s


def _read_line_raw(f: Any) -> dict[str, Any]:
    """A header line from an unbuffered socket file, read byte by byte (nothing after it is consumed)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = f.read(1)
        if not byte or len(line) > _MAX_HEADER:
            raise StorageError("memory-tier peer closed the connection or sent a malformed header")
        line += byte
    return json.loads(line)


class _Stream(io.RawIOBase):
    """``size`` bytes of a file arriving on a socket, read once, front to back: each ``readinto`` waits until
    the caller's buffer is full (MSG_WAITALL; the socket is blocking with kernel deadlines), so a piece costs
    one system call, and the kernel wakes it once per ``WAKE_BYTES`` arrived, not per segment."""

    def __init__(self, sock: socket.socket, size: int, what: str, timeout_s: float) -> None:
        self._sock = sock
        self.size = size
        self._left = size
        self._what = what
        self._timeout_s = timeout_s
        self._wake_bytes = 1  # the kernel's default

    def _wake_after(self, nbytes: int) -> None:
        """Wake the receive once ``nbytes`` (at most ``WAKE_BYTES``) have arrived; never more than the caller
        still waits for, or the end of the file would never wake it."""
        wanted = max(1, min(nbytes, WAKE_BYTES))
        if wanted != self._wake_bytes:
            with contextlib.suppress(OSError):  # an advice: without it every segment wakes the receive
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
            self._wake_bytes = wanted

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[: self._left]
        if not len(view):
            return 0
        self._wake_after(len(view))
        try:
            n = self._sock.recv_into(view, len(view), socket.MSG_WAITALL)
        except BlockingIOError as e:
            raise CheckpointTimeoutError(f"{self._what}: the peer sent nothing for {self._timeout_s:g} s") from e
        if not n:
            raise PeerError(f"{self._what}: the peer stopped after {self.size - self._left} of {self.size} bytes")
        self._left -= n
        return n


class FileServer:
    """Serves (and receives) the files under ``root`` on a background thread until ``close``."""

    def __init__(self, root: str, token: str, timeout_s: float, bind: str = "0.0.0.0") -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self._server = _Server((bind, 0), LocalStorage(root), token, timeout_s)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="nxd_ckpt_tier_server", daemon=True)
        self._thread.start()

    @property
    def token(self) -> str:
        """The token requests must carry."""
        return self._server.token

    @token.setter
    def token(self, token: str) -> None:
        self._server.token = token

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class PeerError(StorageError):
    """A memory-tier peer could not be reached, or refused or failed a request."""


class MissingOnPeer(PeerError):
    """The peer does not hold the requested file."""


class FileClient:
    """Requests to the file servers of other nodes; ``address`` is ``host:port``."""

    def __init__(self, token: str, timeout_s: float) -> None:
        self.token = token
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def _connect(self, address: str, what: str) -> Any:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        except TimeoutError as e:
            raise CheckpointTimeoutError(
                f"{what}: the memory-tier peer {address} did not accept a connection within {self.timeout_s:g} s"
            ) from e
        except OSError as e:
            raise PeerError(f"{what}: cannot reach the memory-tier peer {address}: {e.strerror or e}") from e
        try:
            with sock:
                yield sock
        except TimeoutError as e:
            raise CheckpointTimeoutError(
                f"{what}: the memory-tier peer {address} sent nothing for {self.timeout_s:g} s"
            ) from e

    def _reply(self, sock: socket.socket, address: str, what: str) -> dict[str, Any]:
        with sock.makefile("rb") as f:
            header = _read_line(f)
        if not header.get("ok"):
            cls = MissingOnPeer if header.get("missing") else PeerError
            raise cls(f"{what}: the memory-tier peer {address} answered: {header.get('error')}")
        return header

    def put_file(self, address: str, path: str, local_file: str) -> None:
        """Copy the local file to ``path`` under the peer's root (it appears there complete or not at all)."""
        what = f"copying {path} to {address}"
        with self._connect(address, what) as sock, open(local_file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _send_header(sock, {"token": self.token, "op": "put", "path": path, "size": size})
            try:
                if size:
                    _send_file(sock, f, size, what, self.timeout_s)
            except (BrokenPipeError, ConnectionResetError) as e:  # the peer refused early: its answer says why
                try:
                    self._reply(sock, address, what)
                except PeerError:
                    raise
                except Exception:
                    pass
                raise PeerError(f"{what}: the memory-tier peer {address} closed the connection: {e}") from e
            self._reply(sock, address, what)

    def delete(self, address: str, path: str) -> None:
        what = f"deleting {path} on {address}"
        with self._connect(address, what) as sock:
            _send_header(sock, {"token": self.token, "op": "delete", "path": path})
            self._reply(sock, address, what)

    @contextlib.contextmanager
    def open_stream(self, address: str, path: str) -> Iterator[_Stream]:
        """The peer's file as a read-once stream: bytes go from the socket straight into the caller's buffers."""
        what = f"fetching {path} from {address}"
        with self._connect(address, what) as sock:
            _send_header(sock, {"token": self.token, "op": "get", "path": path})
            f = sock.makefile("rb", buffering=0)
            try:
                header = _read_line_raw(f)
                if not header.get("ok"):
                    cls = MissingOnPeer if header.get("missing") else PeerError
                    raise cls(f"{what}: the memory-tier peer {address} answered: {header.get('error')}")
                _kernel_deadlines(sock, self.timeout_s)
                stream = _Stream(sock, int(header["size"]), what, self.timeout_s)
                yield stream
            finally:
                f.close()

    def get(
        self,
        address: str,
        path: str,
        allocate: Callable[[int], np.ndarray] | None = None,
        on_piece: Callable[[memoryview], None] | None = None,
    ) -> np.ndarray:
        """The whole file, in one array from ``allocate``; ``on_piece`` sees each piece as it arrives."""
        what = f"fetching {path} from {address}"
        with self._connect(address, what) as sock:
            _send_header(sock, {"token": self.token, "op": "get", "path": path})
            f = sock.makefile("rb")
            try:
                header = _read_line(f)
                if not header.get("ok"):
                    cls = MissingOnPeer if header.get("missing") else PeerError
                    raise cls(f"{what}: the memory-tier peer {address} answered: {header.get('error')}")
                size = int(header["size"])
                buffer = allocate(size) if allocate is not None else np.empty(size, dtype=np.uint8)
                view = memoryview(buffer).cast("B")
                done = 0
                while done < size:
                    n = f.readinto(view[done : min(size, done + _PIECE)])
                    if not n:
                        raise PeerError(f"{what}: the peer stopped after {done} of {size} bytes")
                    if on_piece is not None:
                        on_piece(view[done : done + n])
                    done += n
                return buffer[:size]
            finally:
                f.close()
