"""scripts/benchmark.py's memory sections: host memory per path, the first async save, verified plain loads, and
memory-tier restores against memcpy and loopback-socket baselines, all in the same run as the other rows.

Sections (registered on benchlib's registry when benchmark.py imports this module):
  nxd_plain_verified  plain save; verified load into fresh dicts (compare: torch_save's torch.load)
  nxd_plain_live      plain save; verified load into the live module (compare: torch_load_live)
  nxd_memory          peak extra host memory (C heap in use or new resident pages, whichever is larger;
                      largest rank) of a sync save, an async save, an async save with a budget of a quarter
                      of the rank's state, and a verified load into fresh dicts,
                      each as a multiple of the rank's state; the first async save of a fresh manager (new
                      staging buffers, writer thread) against the median of the next two (steady state)
  nxd_tier            memory-tier restores (each rank its own node: LOCAL_WORLD_SIZE=1 for the section, so 2 ranks
                      are 2 nodes, replicas=1) into the live targets: from node memory, and from the peer (node 0's
                      memory directory moved away); a memcpy of the same bytes into the same targets and a loopback
                      TCP copy of them (rank 1 -> rank 0) measured just before; peak memory of the restore
``report_lines`` prints the targets and whether each is met.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from benchlib import (
    Bench,
    CpuTime,
    PeakRSS,
    Timing,
    assert_same,
    check_live,
    dist_all_gather,
    live,
    receive_exactly,
    section,
)


def _rank_bytes(b: Any) -> int:
    """Bytes of the state this rank loads: the model and its optimizer shard."""
    from nxd_ckpt.tree import iter_tensors

    return sum(t.numel() * t.element_size() for _, t in iter_tensors([b.model, b.optimizer]))


def _multiple(b: Any, peak: PeakRSS, saved: int | None = None) -> float:
    """Largest rank's peak extra heap as a multiple of its own state: ``saved`` (the bytes it wrote: the save
    paths) or what it loads."""
    return max(dist_all_gather(peak.extra / (saved or _rank_bytes(b))))


@section("nxd_plain_verified", "nxd_ckpt plain, verified load into fresh dicts")
def _plain_verified(b: Bench) -> Timing:
    """Plain save; verified load into fresh dicts."""
    import nxd_ckpt as nxd

    path = b.path("nxd_plain_v")
    out: dict = {}

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True)

    def load() -> None:
        out["model"], out["optim"] = {}, {}
        nxd.load_checkpoint(path, "step_1", model=out["model"], optimizer=out["optim"])

    result = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, out["model"], "nxd_plain_verified model")
    out.clear()
    b.clean("nxd_plain_v")
    return result


@section("nxd_plain_live", "nxd_ckpt plain, verified load into the live module (optimizer into {})")
def _plain_live(b: Bench) -> Timing:
    """Plain save; verified load into the live module."""
    import nxd_ckpt as nxd

    path = b.path("nxd_plain_live")
    module = live(b)

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True)

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=module, optimizer={})

    result = Timing(b.timed(save), b.timed_load(load))
    check_live(b, module, "nxd_plain_live model")
    b.clean("nxd_plain_live")
    return result


@section("nxd_memory", "nxd_ckpt xser: sync save (timed) and verified load; peak host memory of each path")
def _memory(b: Bench) -> Timing:
    """Peak host memory of each save/load path."""
    return _memory_section(b)


@section("nxd_tier", "nxd_ckpt memory tier: save, restore from node memory (load column)")
def _tier(b: Bench) -> Timing:
    """Memory-tier restores against memcpy and loopback-socket baselines."""
    return _tier_section(b)


def _memory_section(b: Bench) -> Timing:
    import nxd_ckpt as nxd

    path = b.path("nxd_memory")
    kw: dict[str, Any] = dict(model=b.model, optimizer=b.optimizer, use_xser=True, zero1_optimizer=True)
    extra: dict[str, float] = {}
    manager = nxd.CheckpointManager()  # fresh: its first async save allocates staging buffers, starts the writer
    blocked = []
    for i in range(3):
        dist.barrier()
        report = manager.save(path, f"async_{i}", async_save=True, **kw)
        report.wait()
        blocked.append(max(dist_all_gather(report.blocked_s)))
    manager.finalize()
    extra["first_async_blocked_s"], extra["steady_async_blocked_s"] = blocked[0], statistics.median(blocked[1:])

    def first_async_save_measured(tag: str, budget: int | None = None) -> tuple[Any, PeakRSS]:
        """A fresh manager's first async save under ``PeakRSS``, untimed (its 2 ms sampler and gc.collect would
        sit inside a timed save's blocked time)."""
        fresh = nxd.CheckpointManager(host_memory_budget=budget)
        peak = PeakRSS()
        dist.barrier()
        with peak:
            report = fresh.save(path, tag, async_save=True, **kw)
            report.wait()
        fresh.finalize()
        return report, peak

    report, peak = first_async_save_measured("async_peak")
    extra["mem_async"] = _multiple(b, peak, saved=report.bytes_written)
    budget = report.bytes_written // 4  # a quarter of what this rank writes
    report, peak = first_async_save_measured("async_budget", budget)
    extra["mem_async_budget"] = _multiple(b, peak, saved=report.bytes_written)
    over = max(dist_all_gather(peak.extra - budget))
    extra["mem_async_budget_over_bytes"] = over  # the largest rank's peak above its budget
    extra["budget_wait_s"] = max(dist_all_gather(report.budget_wait_s))
    peak = PeakRSS()

    written: list[int] = []

    def save() -> None:
        with peak:
            written.append(nxd.save_checkpoint(path, "sync", **kw).bytes_written)

    save_s = b.timed(save)
    extra["mem_sync"] = _multiple(b, peak, saved=written[0])
    out: dict = {}

    def load() -> None:
        out["model"], out["optim"] = {}, {}
        nxd.load_checkpoint(path, "sync", model=out["model"], optimizer=out["optim"])

    load_s, peak = b.timed_load_then_peak(load, reset=out.clear)
    extra["mem_load_fresh"] = _multiple(b, peak)  # the loaded state itself is in it: ~1.0 is no extra copy
    out.clear()
    b.clean("nxd_memory")
    return Timing(save_s, load_s, extra)


def _training_step(x: torch.Tensor, w: torch.Tensor) -> float:
    """A stand-in for one training step's host work (fixed matmuls); returns its seconds."""
    start = time.perf_counter()
    for _ in range(4):
        x = torch.tanh(x @ w)
    return time.perf_counter() - start


def first_async_save(b: Any) -> dict[str, float]:
    """The first async save of this process, as a training script makes it: ``prepare_async_save`` once the model
    and optimizer exist, training steps while its buffers are faulted in beside them (each step timed, against
    steps once that is done), then the save; and the median of the next two saves. Blocked time of the slowest
    rank; nothing else ran in this process before."""
    import nxd_ckpt as nxd

    path = b.path("nxd_first_async")
    save = nxd.save_checkpoint  # imported before timing, as a training script imports it at its start
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024) / 32
    baseline = [_training_step(x, w) for _ in range(5)]
    dist.barrier()
    start = time.perf_counter()
    nxd.prepare_async_save(model=b.model, optimizer=b.optimizer)
    prepare_call_s = time.perf_counter() - start
    pool = nxd.get_manager()._staging_pool
    during: list[float] = []
    while not pool.wait_prepared(timeout=0):
        during.append(_training_step(x, w))
    faulted_s = time.perf_counter() - start
    after = [_training_step(x, w) for _ in range(5)]
    blocked = []
    for i in range(3):
        dist.barrier()
        start = time.perf_counter()
        report = save(path, f"async_{i}", model=b.model, optimizer=b.optimizer, use_xser=True,
                                     zero1_optimizer=True, async_save=True)  # fmt: skip
        blocked.append(max(dist_all_gather(time.perf_counter() - start)))
        report.wait()
    nxd.finalize_checkpoint()
    b.clean("nxd_first_async")
    step_during = statistics.median(during) if during else float("nan")
    return {
        "process_first_async_s": blocked[0],
        "process_steady_async_s": statistics.median(blocked[1:]),
        "prepare_call_s": max(dist_all_gather(prepare_call_s)),
        "prepare_faulted_s": max(dist_all_gather(faulted_s)),
        "step_during_prepare_s": max(dist_all_gather(step_during)),
        "steps_during_prepare": min(dist_all_gather(len(during))),
        "step_after_prepare_s": max(dist_all_gather(statistics.median(after + baseline))),
    }


# ----------------------------------------------------------------------------------------------- memory tier
def _touched_like(tree: Any) -> Any:
    from nxd_ckpt.tree import map_tensors

    return map_tensors(tree, lambda t: torch.full_like(t, -1.0))


def _tensors(tree: Any) -> list[torch.Tensor]:
    from nxd_ckpt.tree import iter_tensors

    return [t for _, t in iter_tensors(tree)]


def _copy(sources: list[torch.Tensor], dests: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dests, sources, strict=True):
            d.copy_(s)


def _memcpy_s(sources: list[torch.Tensor], dests: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    _copy(sources, dests)
    return max(dist_all_gather(time.perf_counter() - start))


def _socket_s(
    sources: list[torch.Tensor], receive_into: torch.Tensor, own_copy: Callable[[], object] | None = None
) -> float:
    """Rank 1 sends the bytes rank 0 restores over one loopback TCP connection (sendall of each tensor); rank 0
    receives them into a touched buffer. Rank 0's time. With ``own_copy``, rank 1 runs it (the memcpy of its own
    state) while a thread sends: in the peer restore, rank 1 restores its own state while its file server sends."""
    nbytes = receive_into.numel()
    listener = socket.create_server(("127.0.0.1", 0)) if dist.get_rank() == 0 else None
    port = dist_all_gather(listener.getsockname()[1] if listener is not None else 0)[0]
    dist.barrier()
    elapsed = 0.0
    if listener is not None:
        view = memoryview(receive_into.numpy())
        conn, _ = listener.accept()
        start = time.perf_counter()
        with conn:
            receive_exactly(conn, view, nbytes)
        elapsed = time.perf_counter() - start
        listener.close()
    elif dist.get_rank() == 1:

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as conn:
                for t in sources:
                    conn.sendall(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))

        sender = threading.Thread(target=send)
        sender.start()
        if own_copy is not None:
            own_copy()
        sender.join()
    return dist_all_gather(elapsed)[0]


def _tier_section(b: Bench) -> Timing:
    import nxd_ckpt as nxd

    saved_env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "NXD_CKPT_MEMORY_TIER_HOST")}
    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", NXD_CKPT_MEMORY_TIER_HOST="127.0.0.1")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mem = dist_all_gather(tempfile.mkdtemp(prefix="nxd_bench_tier_", dir=shm))[0]
    tier = nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1 if b.world > 1 else 0, bind="127.0.0.1")
    path = b.path("nxd_tier")
    targets = (_touched_like(b.model), _touched_like(b.optimizer))
    sources, dests = _tensors([b.model, b.optimizer]), _tensors(list(targets))
    extra: dict[str, float] = {}
    try:
        manager = nxd.CheckpointManager(memory_tier=tier)
        save_s = b.timed(lambda: manager.save(path, "step_1", model=b.model, optimizer=b.optimizer,
                                              zero1_optimizer=True))  # fmt: skip
        manager.finalize()

        def restore(label: str, peak: PeakRSS | None = None) -> float:
            for t in dests:
                t.fill_(-1.0)
            restorer = nxd.CheckpointManager(memory_tier=tier)

            def load() -> None:
                with peak or contextlib.nullcontext():
                    restorer.load(path, model=targets[0], optimizer=targets[1])

            with CpuTime() as cpu:
                seconds = b.timed(load)
            if peak is None:
                extra[f"tier_cpu_{label}"] = sum(dist_all_gather(cpu.used_s))
            where = restorer.last_restore
            assert where is not None and where.tier == label, where
            restorer.finalize()
            if b.check:
                assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True)), f"tier {label} restore"
            if peak is None:  # peak memory from one more, untimed load: its 2 ms sampler thread stays out of the time
                peak = PeakRSS()
                restore(label, peak)
                extra[f"mem_tier_{label}"] = _multiple(b, peak)
            return seconds

        extra["tier_memcpy_s"] = _memcpy_s(sources, dests)
        load_s = restore("memory")
        if b.world > 1:
            into = torch.ones(sum(t.numel() * t.element_size() for t in sources), dtype=torch.uint8)
            with CpuTime() as cpu:
                extra["tier_socket_s"] = _socket_s(sources, into)
            extra["tier_cpu_socket"] = sum(dist_all_gather(cpu.used_s))
            extra["tier_socket_serving_s"] = _socket_s(sources, into, own_copy=lambda: _copy(sources, dests))
            if b.rank == 0:
                os.rename(os.path.join(mem, "node0"), os.path.join(mem, "node0.lost"))
            dist.barrier()
            extra["tier_peer_s"] = restore("peer")
        extra["tier_memory_s"] = load_s
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
    return Timing(save_s, load_s, extra)


# ----------------------------------------------------------------------------------------------- report
def report_lines(data: dict, med: dict[str, tuple[float | None, float | None]]) -> list[str]:
    """The host-memory, first-async-save and memory-tier targets from one run, each with MET / NOT MET."""
    extra = data.get("extra", {})
    lines = ["", "memory sections (each ratio taken within this run):"]

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    def load_ratio(mine: str, theirs: str, what: str) -> None:
        if mine in med and theirs in med and med[mine][1] and med[theirs][1]:
            r = med[theirs][1] / med[mine][1]
            lines.append(f"  load {what}: {r:.2f}x {theirs} (target >= 1.0): {verdict(r >= 1.0)}")

    load_ratio("nxd_plain_verified", "torch_save", "plain, verified, fresh dicts vs torch.load")
    load_ratio("nxd_xser_fresh" if "nxd_xser_fresh" in med else "nxd_xser", "torch_save",
               "xser, verified, fresh dicts vs torch.load")  # fmt: skip
    load_ratio("nxd_plain_live", "torch_load_live", "plain, verified, live module vs torch.load + load_state_dict")
    load_ratio("nxd_xser_live", "torch_load_live", "xser, verified, live module vs torch.load + load_state_dict")
    first = data.get("first_async")
    if first:
        ratio = first["process_first_async_s"] / first["process_steady_async_s"]
        lines.append(
            f"  first async save of the process blocks {first['process_first_async_s']:.3f} s, the next ones "
            f"{first['process_steady_async_s']:.3f} s: {ratio:.2f}x (target <= 1.5): {verdict(ratio <= 1.5)}"
        )
        if "prepare_call_s" in first:
            slow = first["step_during_prepare_s"] / first["step_after_prepare_s"]
            lines.append(
                f"    after prepare_async_save (returned in {first['prepare_call_s'] * 1e3:.1f} ms; buffers faulted "
                f"in {first['prepare_faulted_s']:.2f} s beside {first['steps_during_prepare']} training steps): a "
                f"step took {first['step_during_prepare_s'] * 1e3:.1f} ms meanwhile, "
                f"{first['step_after_prepare_s'] * 1e3:.1f} ms otherwise ({slow:.2f}x; host work of a stand-in "
                "step, 2 ranks on this VM's 2 cores)"
            )
    runs = extra.get("nxd_memory", [])
    if runs:
        first = statistics.median(r["first_async_blocked_s"] for r in runs)
        steady = statistics.median(r["steady_async_blocked_s"] for r in runs)
        ratio = statistics.median(r["first_async_blocked_s"] / r["steady_async_blocked_s"] for r in runs)
        lines.append(f"  without prepare_async_save, the first async save of a fresh manager blocks {first:.3f} s, "
                     f"steady {steady:.3f} s: {ratio:.2f}x (no target: its staging memory is faulted in during "
                     "the call)")  # fmt: skip
        for key, what in (
            ("mem_sync", "sync save"),
            ("mem_async", "async save"),
            ("mem_async_budget", "async save, budget = 1/4 of the state"),
            ("mem_load_fresh", "verified load into fresh dicts (holds the loaded state: 1.0 = no extra)"),
        ):
            values = [r[key] for r in runs]
            lines.append(f"  peak extra host memory, {what}: {statistics.median(values):.2f}x the rank's state "
                         f"[{', '.join(f'{v:.2f}' for v in values)}]")  # fmt: skip
        budget_ok = all(r["mem_async_budget_over_bytes"] <= 64 << 20 for r in runs)
        waited = statistics.median(r["budget_wait_s"] for r in runs)
        lines.append(
            f"  async save under a budget of 1/4 of the state holds <= budget + 64 MiB: {verdict(budget_ok)}; "
            f"the call waited {waited:.3f} s for what did not fit"
        )
    return lines + _tier_lines(extra.get("nxd_tier", []), verdict)


def _tier_lines(tier: list[dict[str, float]], verdict: Callable[[bool], str]) -> list[str]:
    """The memory-tier targets of ``report_lines``."""
    lines: list[str] = []
    if tier:
        mem = statistics.median(r["tier_memory_s"] / r["tier_memcpy_s"] for r in tier)
        lines.append(f"  tier restore from node memory: {mem:.2f}x a memcpy of the same bytes (target <= 1.5): "
                     f"{verdict(mem <= 1.5)}")  # fmt: skip
        if "tier_peer_s" in tier[0]:
            peer = statistics.median(r["tier_peer_s"] / r["tier_socket_s"] for r in tier)
            lines.append(f"  tier restore from the peer: {peer:.2f}x a loopback socket copy of the same bytes "
                         f"(target <= 2.0): {verdict(peer <= 2.0)}")  # fmt: skip
            if "tier_cpu_peer" in tier[0]:
                cores = os.cpu_count() or 1
                floor = statistics.median(r["tier_cpu_peer"] / cores / r["tier_socket_s"] for r in tier)
                lines.append(f"    CPU time of both ranks: restore from the peer "
                             f"{statistics.median(r['tier_cpu_peer'] for r in tier):.2f} CPU-s, the socket copy "
                             f"{statistics.median(r['tier_cpu_socket'] for r in tier):.2f}; on {cores} cores the "
                             f"restore's work alone takes at least {floor:.2f}x the socket copy")  # fmt: skip
            serving = statistics.median(r["tier_peer_s"] / r["tier_socket_serving_s"] for r in tier)
            lines.append(f"  tier restore from the peer: {serving:.2f}x the same socket copy while the sending rank "
                         "copies its own state, as it does in the restore (target <= 2.0): "
                         f"{verdict(serving <= 2.0)}")  # fmt: skip
        for label in ("memory", "peer"):
            values = [r[f"mem_tier_{label}"] for r in tier if f"mem_tier_{label}" in r]
            if values:
                lines.append(f"  peak extra host memory, tier restore from {label}: {statistics.median(values):.2f}x "
                             "the rank's state")  # fmt: skip
    return lines
