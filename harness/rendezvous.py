"""Where the test harnesses' ranks meet: a c10d TCPStore that the parent serves on a port it bound itself.

The rule (docs/testing.md): a harness never picks a free port, closes it and binds it again later (another
process can take it in between: ``DistNetworkError ... EADDRINUSE``). Instead the parent binds port 0 for its
store and hands the port it got to the ranks, which join as clients, as torchrun's agent does with its store.
The parent writes ``SERVED_BY_KEY`` (its pid) into the store before any rank starts, so a rank can check that
it met the parent's store and not one of its own making.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

HOST = "127.0.0.1"
SERVED_BY_KEY = "nxd_ckpt_testing/served_by"
"""Store key holding the pid of the process that serves the rendezvous store."""


def serve_store(timeout_s: float = 120.0) -> Any:
    """A TCPStore served by this process on 127.0.0.1 and a port the kernel chose (read it from ``.port``)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    store.set(SERVED_BY_KEY, str(os.getpid()))
    return store


def connect_store(port: int, timeout_s: float = 120.0) -> Any:
    """A client of the store served on 127.0.0.1:``port``."""
    import torch.distributed as dist

    return dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def init_process_group(
    port: int, rank: int, world_size: int, timeout_s: float = 120.0, backend: str = "gloo", prefix: str = ""
) -> None:
    """Join the default process group through the store served on ``port`` (keys under ``prefix`` when a
    group is made again over the same store, e.g. to change its backend)."""
    import torch.distributed as dist

    store = connect_store(port, timeout_s)
    if prefix:
        store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


def served_by(port: int, timeout_s: float = 30.0) -> int:
    """The pid of the process serving the store on ``port`` (as it wrote it before handing the port out)."""
    return int(connect_store(port, timeout_s).get(SERVED_BY_KEY))
