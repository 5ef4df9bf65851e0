"""``nxd_tier``: memory-tier restores into the live targets (each rank its own node: LOCAL_WORLD_SIZE=1 for the
section, so 2 ranks are 2 nodes, replicas=1) from node memory and from the peer (node 0's memory directory moved
away), against a memcpy of the same bytes into the same targets and a loopback TCP copy of them (rank 1 -> rank
0), measured just before; peak memory of the restore."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.core.baselines import copy_into, receive_timed, send_while
from benchmarks.core.memory import CpuTime, PeakRSS
from benchmarks.core.ranks import gather, slowest
from benchmarks.core.state import nbytes_of, tensors_of, touched_like
from benchmarks.suites.saveload.bench import Bench, Timing, section


def socket_s(sources: list[torch.Tensor], into: torch.Tensor, own_copy: Callable[[], object] | None = None) -> float:
    """Rank 1 sends the bytes rank 0 restores over one loopback TCP connection (sendall of each tensor); rank 0
    receives them into a touched buffer. Rank 0's time. With ``own_copy``, rank 1 runs it (the memcpy of its own
    state) while a thread sends: in the peer restore, rank 1 restores its own state while its file server sends."""
    listener = socket.create_server(("127.0.0.1", 0)) if dist.get_rank() == 0 else None
    port = gather(listener.getsockname()[1] if listener is not None else 0)[0]
    dist.barrier()
    elapsed = 0.0
    if listener is not None:
        elapsed = receive_timed(listener, into)
    elif dist.get_rank() == 1:
        send_while(port, sources, own_copy)
    return gather(elapsed)[0]


@contextlib.contextmanager
def nodes_of_one_rank(b: Bench) -> Iterator[str]:
    """Each rank its own node for the block, the tier's memory directories in a fresh /dev/shm directory (its
    path yielded); the environment and the directories are put back after."""
    saved_env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "NXD_CKPT_MEMORY_TIER_HOST")}
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", NXD_CKPT_MEMORY_TIER_HOST="127.0.0.1")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mem = gather(tempfile.mkdtemp(prefix="nxd_bench_tier_", dir=shm))[0]
    try:
        yield mem
    finally:
        dist.barrier()
        if b.rank == 0:
            shutil.rmtree(mem, ignore_errors=True)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        b.clean("nxd_tier")


class Restores:
    """Restores of one saved tag through fresh managers into touched targets, checked, with their figures."""

    def __init__(self, b: Bench, tier: Any, path: str) -> None:
        self.b, self.tier, self.path = b, tier, path
        self.targets = (touched_like(b.model), touched_like(b.optimizer))
        self.sources, self.dests = tensors_of([b.model, b.optimizer]), tensors_of(list(self.targets))
        self.extra: dict[str, float] = {}

    def restore(self, label: str, peak: PeakRSS | None = None) -> float:
        """One restore (expected from ``label``: memory or peer), timed; the first also measures peak memory in
        one more, untimed restore (its 2 ms sampler thread stays out of the time)."""
        import nxd_ckpt as nxd

        for t in self.dests:
            t.fill_(-1.0)
        restorer = nxd.CheckpointManager(memory_tier=self.tier)

        def load() -> None:
            with peak or contextlib.nullcontext():
                restorer.load(self.path, model=self.targets[0], optimizer=self.targets[1])

        with CpuTime() as cpu:
            seconds = self.b.timed(load)
        where = restorer.last_restore
        assert where is not None and where.tier == label, where
        restorer.finalize()
        if self.b.check:
            assert all(torch.equal(d, s) for d, s in zip(self.dests, self.sources, strict=True)), f"tier {label}"
        if peak is None:
            self.extra[f"tier_cpu_{label}"] = sum(gather(cpu.used_s))
            peak = PeakRSS()
            self.restore(label, peak)
            self.extra[f"mem_tier_{label}"] = max(gather(peak.extra / nbytes_of([self.b.model, self.b.optimizer])))
        return seconds

    def baselines(self) -> None:
        """The loopback socket copy alone, and while the sending rank copies its own state."""
        into = torch.ones(sum(t.numel() * t.element_size() for t in self.sources), dtype=torch.uint8)
        with CpuTime() as cpu:
            self.extra["tier_socket_s"] = socket_s(self.sources, into)
        self.extra["tier_cpu_socket"] = sum(gather(cpu.used_s))
        own_copy = lambda: copy_into(self.sources, self.dests)  # noqa: E731
        self.extra["tier_socket_serving_s"] = socket_s(self.sources, into, own_copy=own_copy)


@section("nxd_tier", "nxd_ckpt memory tier: save, restore from node memory (load column)")
def nxd_tier(b: Bench) -> Timing:
    """Memory-tier restores against memcpy and loopback-socket baselines."""
    import nxd_ckpt as nxd

    with nodes_of_one_rank(b) as mem:
        tier = nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1 if b.world > 1 else 0, bind="127.0.0.1")
        path = b.path("nxd_tier")
        manager = nxd.CheckpointManager(memory_tier=tier)
        save_s = b.timed(lambda: manager.save(path, "step_1", model=b.model, optimizer=b.optimizer,
                                              zero1_optimizer=True))  # fmt: skip
        manager.finalize()
        restores = Restores(b, tier, path)
        dist.barrier()
        restores.extra["tier_memcpy_s"] = slowest(copy_into(restores.sources, restores.dests))
        load_s = restores.restore("memory")
        if b.world > 1:
            restores.baselines()
            if b.rank == 0:
                os.rename(os.path.join(mem, "node0"), os.path.join(mem, "node0.lost"))
            dist.barrier()
            restores.extra["tier_peer_s"] = restores.restore("peer")
        restores.extra["tier_memory_s"] = load_s
    return Timing(save_s, load_s, restores.extra)
