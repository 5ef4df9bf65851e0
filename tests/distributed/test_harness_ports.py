"""The harnesses' port rule: a server binds port 0 itself and hands its port out; nothing picks a free port,
releases it and binds it again later (another process could take it in between: EADDRINUSE)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch.distributed as dist

from harness import rendezvous
from harness.multiprocess import harness_pid, run_on_ranks, run_with_ranks

pytestmark = pytest.mark.device_independent


def test_the_store_is_served_before_its_port_is_handed_out():
    store = rendezvous.serve_store(timeout_s=10)
    assert store.port > 0
    assert rendezvous.served_by(store.port, timeout_s=5) == os.getpid()


@run_with_ranks(2)
def test_ranks_meet_at_the_store_their_parent_serves():
    port = int(os.environ["MASTER_PORT"])
    assert rendezvous.served_by(port, timeout_s=5) == harness_pid()  # not a store rank 0 bound later
    assert dist.get_world_size() == 2


def _group_works() -> None:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, dist.get_rank())
    assert out == list(range(dist.get_world_size()))


class _PortGrabber(threading.Thread):
    """Another process's worth of churn: keeps binding (and listening on) new ephemeral ports, holding the last
    ``hold`` of them, as a busy machine does while a harness starts its ranks."""

    def __init__(self, hold: int = 64) -> None:
        super().__init__(daemon=True)
        self.hold, self.grabbed, self._done = hold, 0, threading.Event()

    def run(self) -> None:
        held: list[socket.socket] = []
        while not self._done.is_set():
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            held.append(s)
            self.grabbed += 1
            if len(held) > self.hold:
                held.pop(0).close()
        for s in held:
            s.close()

    def stop(self) -> None:
        self._done.set()
        self.join()


def test_ranks_start_while_other_sockets_keep_taking_ports():
    grabber = _PortGrabber()
    grabber.start()
    try:
        run_on_ranks(_group_works, 3, timeout=120)
    finally:
        grabber.stop()
    assert grabber.grabbed > 100
