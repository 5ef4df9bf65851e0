"""What a path is compared with: a memcpy of the same bytes into a touched host buffer, and a loopback socket
copy of them (the floor of a restore from a peer)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

_BUFFERS: dict[int, torch.Tensor] = {}


def touched_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer of ``nbytes``, allocated and touched once per size and reused (the last size only)."""
    if nbytes not in _BUFFERS:
        _BUFFERS.clear()
        _BUFFERS[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
    return _BUFFERS[nbytes]


def aligned_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Destinations shaped like ``tensors`` in one touched buffer, each 64-byte aligned as separately allocated
    tensors are."""
    nbytes = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    flat, views, offset = touched_buffer(nbytes), [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
        offset += -(-n // 64) * 64
    return views


def copy_into(sources: list[torch.Tensor], dests: list[torch.Tensor]) -> float:
    """Copy each source into its destination; the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dests, sources, strict=True):
            d.copy_(s)
    return time.perf_counter() - start


def receive_exactly(conn: Any, view: memoryview, nbytes: int) -> None:
    """Fill ``view[:nbytes]`` from the socket ``conn`` in 8 MiB reads (the loopback-copy baseline's receiver)."""
    done = 0
    while done < nbytes:
        n = conn.recv_into(view[done : done + (8 << 20)])
        if not n:
            raise RuntimeError("the socket baseline's sender stopped early: the peer rank failed or was killed")
        done += n


def receive_timed(listener: socket.socket, into: torch.Tensor) -> float:
    """Accept one connection on ``listener`` and receive ``into``'s bytes; seconds from the accept."""
    view = memoryview(into.numpy())
    conn, _ = listener.accept()
    start = time.perf_counter()
    with conn:
        receive_exactly(conn, view, into.numel())
    listener.close()
    return time.perf_counter() - start


def send_while(port: int, tensors: list[torch.Tensor], own_copy: Callable[[], object] | None = None) -> None:
    """Send ``tensors`` to 127.0.0.1:``port`` on a thread (sendall of each), running ``own_copy`` meanwhile (a
    serving rank restores its own state while its file server sends)."""

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            for t in tensors:
                conn.sendall(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))

    sender = threading.Thread(target=send)
    sender.start()
    if own_copy is not None:
        own_copy()
    sender.join()
