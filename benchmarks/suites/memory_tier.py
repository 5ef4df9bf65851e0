"""Memory tier benchmark: recovery time from node memory, from a peer node, and from durable storage (cold), for
the same state, and what the tiers add to the time a save blocks training.

    $(bash scripts/setup_env.sh cpu | tail -1) -m benchmarks memory_tier [--total-mib 512] [--repeats 3]

4 spawned gloo ranks as 2 simulated nodes (LOCAL_WORLD_SIZE=2), each node with its own memory directory under
/dev/shm (``MemoryTier(dir=.../node{node})``, replicas=1). State: a replicated fp32 model (written by rank 0)
plus each rank's ZeRO-1 shard of AdamW state, --total-mib in all. In one run, on the same processes:
  blocked    async saves without and with the tier (durable every save, so both write the same files to the
             same disk; which goes first alternates), each waited for before the next: median over repeats of the
             slowest rank's time blocked in ``save_checkpoint``;
  recovery   a fresh manager loads the newest tag (the slowest rank's time in ``load_checkpoint``):
             memory  every rank reads its node's memory directory;
             peer    node 0's memory directory is moved away (a replaced node): its ranks fetch from node 1;
             durable both memory directories moved away: everything from the checkpoint directory, after dropping
                     the page cache (``/proc/sys/vm/drop_caches`` if writable, else ``posix_fadvise(DONTNEED)``
                     on every checkpoint file; said in the output).
             After one untimed load (the processes' first), the three alternate --repeats times; medians.
             Peak host memory comes from one more, untimed load of each path (its sampler thread would
             slow the timed loads).
  blocked, one process   the same comparison in the parent process alone (a quarter of the state, replicas=0):
             the training thread's own cost of the tier, without 4 ranks competing for the 2 cores.
``NXD_BENCH_PROFILE=<dir>`` writes a cProfile of rank 0's timed restores from memory and from the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.core.baselines import copy_into, receive_timed, send_while, touched_buffer
from benchmarks.core.files import evict
from benchmarks.core.memory import CpuTime, PeakRSS
from benchmarks.core.ranks import on_ranks, write_result
from benchmarks.core.report import Report, verdict
from benchmarks.core.state import flat_state

TITLE = __doc__.splitlines()[0]
SECTIONS = {"recovery": "blocked saves, recovery from memory, peer and durable, with their baselines (4 ranks)",
            "single": "blocked saves with and without the tier in one process"}  # fmt: skip
MIB = 1 << 20


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--total-mib", type=int, default=512, help="tensor data of the whole job")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable-dir", default=None, help="where the checkpoint directory goes (default: a temp dir)")


def optimizer_tensors(optimizer: dict) -> list[torch.Tensor]:
    """The optimizer's moments (the step counters left out)."""
    return [t for s in optimizer["state"].values() for t in s.values() if t.dim() > 0]


def blocked_saves(coord: Any, ckpt: str, model: dict, optimizer: dict, tier: Any, repeats: int) -> dict:
    """Async saves without and with the tier, alternating which goes first (the newest tag is a tier save):
    the slowest rank's blocked time of each."""
    import nxd_ckpt as nxd

    kw = {"model": model, "optimizer": optimizer, "zero1_optimizer": True, "async_save": True, "num_kept_ckpts": 2}
    blocked: dict[str, list[float]] = {"plain": [], "tier": []}
    nxd.save_checkpoint(ckpt, "warmup_plain", **kw).wait()
    nxd.save_checkpoint(ckpt, "warmup_tier", memory_tier=tier, **kw).wait()
    for i in range(repeats):
        last_pair = (repeats - 1 - i) % 2 == 0  # alternate which goes first; the newest tag is a tier save
        for mode in ("plain", "tier") if last_pair else ("tier", "plain"):
            coord.barrier()
            report = nxd.save_checkpoint(ckpt, f"{mode}_{i}", memory_tier=tier if mode == "tier" else None, **kw)
            blocked[mode].append(max(coord.all_gather_object(report.blocked_s, phase="benchmark")))
            report.wait()
            nxd.get_manager().wait_pending()  # retention too: the next save must not wait for anything
    return blocked


def socket_copy_s(coord: Any, read: list[torch.Tensor], peer: int, receiver: bool,
                  own_copy: Callable[[], object] | None = None) -> float:  # fmt: skip
    """The peer restore's baseline: the ranks of node 0 receive the bytes they restore from their peer on node
    1 over one loopback TCP connection, all pairs at once; the slowest receiver's time. With ``own_copy``, each
    sender runs it (its own state's memcpy) while a thread sends, as a serving rank of the peer restore does."""
    listener = socket.create_server(("127.0.0.1", 0)) if receiver else None
    ports = coord.all_gather_object(listener.getsockname()[1] if listener else 0, phase="benchmark: socket baseline")
    coord.barrier()
    elapsed = 0.0
    if listener is not None:
        elapsed = receive_timed(listener, touched_buffer(sum(t.numel() * t.element_size() for t in read)))
    else:
        send_while(ports[peer], read, own_copy)
    return max(coord.all_gather_object(elapsed, phase="benchmark: socket baseline"))


def profiler(rank: int, label: str) -> contextlib.AbstractContextManager:
    """cProfile of rank 0's timed memory and peer restores into the directory ``NXD_BENCH_PROFILE`` names (one
    file per restore), else nothing."""
    directory = os.environ.get("NXD_BENCH_PROFILE")
    if not directory or rank != 0 or label not in ("memory", "peer"):
        return contextlib.nullcontext()
    import cProfile

    @contextlib.contextmanager
    def run() -> Iterator[None]:
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(directory, f"{label}_{time.time_ns()}.prof"))

    return run()


class Recovery:
    """One rank's restores of the newest tag into touched targets, and their baselines and figures."""

    def __init__(self, coord: Any, tier: Any, ckpt: str, model: dict, optimizer: dict, newest: str) -> None:
        self.coord, self.tier, self.ckpt, self.newest = coord, tier, ckpt, newest
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = coord.rank, coord.world_size
        self.target_model = {k: torch.zeros_like(v) for k, v in model.items()}
        self.target_opt = {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                     for i, s in optimizer["state"].items()},
                           "param_groups": [dict(g) for g in optimizer["param_groups"]]}  # fmt: skip
        self.read = [*model.values(), *optimizer_tensors(optimizer)]  # what each rank restores
        self.results: dict[str, Any] = {"restored_bytes": sum(t.numel() * t.element_size() for t in self.read)}

    def slowest(self, seconds: float) -> float:
        """The slowest rank's seconds."""
        return max(self.coord.all_gather_object(seconds, phase="benchmark"))

    def count_cpu(self, label: str, cpu: CpuTime) -> None:
        """The CPU seconds of all ranks (and of the serving node's ranks) for one timed path, and the idle time."""
        used = self.coord.all_gather_object(cpu.used_s, phase="benchmark: CPU time")
        self.results.setdefault(f"cpu_{label}_all", []).append(sum(used))
        self.results.setdefault(f"cpu_{label}_serving_all", []).append(sum(used[self.world // 2 :]))
        self.results.setdefault(f"idle_{label}_all", []).append(cpu.machine_idle_s)

    def memcpy_s(self) -> float:
        """This rank's copy of the bytes it restores into the (touched) tensors a restore fills."""
        return copy_into(self.read, [*self.target_model.values(), *optimizer_tensors(self.target_opt)])

    def check(self) -> None:
        """The targets hold the saved state."""
        assert all(torch.equal(self.target_model[k], self.model[k]) for k in self.model)
        pairs = zip(optimizer_tensors(self.target_opt), optimizer_tensors(self.optimizer), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)

    def load_once(self, label: str, peak: PeakRSS | None) -> float:
        """One load by a fresh manager (the slowest rank's time), checked; with ``peak``, measured by it."""
        import nxd_ckpt as nxd

        manager = nxd.CheckpointManager()
        for t in [*self.target_model.values(), *optimizer_tensors(self.target_opt)]:
            t.fill_(-1.0)  # scribbled: the load must bring every byte back
        self.coord.barrier()
        with peak or contextlib.nullcontext():
            start = time.perf_counter()
            with profiler(self.rank, label) if peak is None else contextlib.nullcontext(), CpuTime() as cpu:
                manager.load(self.ckpt, model=self.target_model, optimizer=self.target_opt, memory_tier=self.tier)
            elapsed = self.slowest(time.perf_counter() - start)
        if peak is None and label != "warmup":
            self.count_cpu(label, cpu)
        restore = manager.last_restore
        assert restore is not None and restore.tag == self.newest, restore
        self.check()
        self.results[f"recovery_{label}_tiers"] = restore.summary()
        manager.finalize()
        return elapsed

    def timed_load(self, label: str) -> float:
        """A timed load; the first of each path is followed by an untimed one measuring its peak memory."""
        elapsed = self.load_once(label, None)
        if label != "warmup" and f"peak_{label}" not in self.results:
            if label == "durable" and self.rank == 0:
                evict(self.ckpt)  # cold again (the load that follows waits for rank 0 at its barrier)
            peak = PeakRSS()
            self.load_once(label, peak)
            self.results[f"peak_{label}"] = [self.slowest(peak.extra)]
        return elapsed

    def baselines(self, out: dict[str, list[float]]) -> None:
        """memcpy, the socket copy, and the socket copy while each sender copies its own state."""
        peer = (self.rank + self.world // 2) % self.world
        receiver = self.rank < self.world // 2
        out["memcpy"].append(self.slowest(self.memcpy_s()))
        with CpuTime() as cpu:
            out["socket"].append(socket_copy_s(self.coord, self.read, peer, receiver))
        self.count_cpu("socket", cpu)
        out["socket_serving"].append(socket_copy_s(self.coord, self.read, peer, receiver, own_copy=self.memcpy_s))

    def one_round(self, mem: str, times: dict[str, list[float]]) -> None:
        """From memory, from the peer (node 0's directory moved away), durable (both moved away, cold)."""
        node0, node1 = os.path.join(mem, "node0"), os.path.join(mem, "node1")
        times["memory"].append(self.timed_load("memory"))
        if self.rank == 0:
            os.rename(node0, node0 + ".lost")
        self.coord.barrier()
        times["peer"].append(self.timed_load("peer"))
        if self.rank == 0:
            os.rename(node1, node1 + ".lost")
            self.results["cold_method"] = evict(self.ckpt)
        self.coord.barrier()
        times["durable"].append(self.timed_load("durable"))
        if self.rank == 0:  # the replaced nodes' new (empty) memory directories give way to the saved ones
            for node_dir in (node0, node1):
                shutil.rmtree(node_dir, ignore_errors=True)
                os.rename(node_dir + ".lost", node_dir)
        self.coord.barrier()


def rank_main(total_mib: int, repeats: int, ckpt: str, mem: str, out: str) -> None:
    """One of the 4 ranks: blocked saves, then the recovery rounds with their baselines."""
    import nxd_ckpt as nxd
    from nxd_ckpt.ranks.coordinator import Coordinator

    coord = Coordinator()
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"  # simulated nodes on one machine meet on loopback
    tier = nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=1, max_copies=4,
                          bind="127.0.0.1")  # fmt: skip
    model, optimizer = flat_state(total_mib * MIB, coord.rank, coord.world_size)
    blocked = blocked_saves(coord, ckpt, model, optimizer, tier, repeats)
    nxd.finalize_checkpoint()
    rec = Recovery(coord, tier, ckpt, model, optimizer, newest=f"tier_{repeats - 1}")
    rec.results |= {"blocked_plain_s": statistics.median(blocked["plain"]), "blocked_all": blocked,
                    "blocked_tier_s": statistics.median(blocked["tier"])}  # fmt: skip
    times: dict[str, list[float]] = {"memory": [], "peer": [], "durable": []}
    baselines: dict[str, list[float]] = {"memcpy": [], "socket": [], "socket_serving": []}
    rec.timed_load("warmup")  # first load of the processes (imports, allocator): not counted
    for _ in range(repeats):
        rec.baselines(baselines)
        rec.one_round(mem, times)
    for label, values in [*times.items(), *baselines.items()]:
        rec.results[f"recovery_{label}_s"] = statistics.median(values)
        rec.results[f"recovery_{label}_all"] = values
    write_result(out, rec.results)


def single_process_blocked(total_mib: int, repeats: int, work: str) -> dict[str, list[float]]:
    """The same comparison in this one process (``replicas=0``): the training thread's own cost of the tier,
    without 4 ranks competing for 2 cores."""
    import nxd_ckpt as nxd

    model, _ = flat_state(total_mib * MIB, 0, 1)
    ckpt, mem = os.path.join(work, "single"), os.path.join(work, "single_mem")
    tier = nxd.MemoryTier(dir=mem, replicas=0, durable_every=1, max_copies=2)
    out: dict[str, list[float]] = {"plain": [], "tier": []}
    for i in range(repeats + 1):
        for mode in ("plain", "tier") if i % 2 == 0 else ("tier", "plain"):
            report = nxd.save_checkpoint(ckpt, f"{mode}_{i}", model=model, async_save=True, num_kept_ckpts=2,
                                         memory_tier=tier if mode == "tier" else None)  # fmt: skip
            if i:  # the first round allocates the staging buffers
                out[mode].append(report.blocked_s)
            report.wait()
            nxd.get_manager().wait_pending()
    nxd.reset_manager()
    return out


def target_lines(report: Report, r: dict) -> None:
    """The memory-tier targets, each ratio paired within one repetition (medians of the pairs)."""
    memcpy, sock, serving = r["recovery_memcpy_all"], r["recovery_socket_all"], r["recovery_socket_serving_all"]
    report.say(f"baselines per rank ({r['restored_bytes'] / MIB:.0f} MiB restored by each): memcpy into the touched "
               f"targets {r['recovery_memcpy_s']:.3f} s (each: {', '.join(f'{v:.3f}' for v in memcpy)}); loopback "
               f"socket copy {r['recovery_socket_s']:.3f} s (each: {', '.join(f'{v:.3f}' for v in sock)}); the same "
               f"socket copy while each sender copies its own state {r['recovery_socket_serving_s']:.3f} s "
               f"(each: {', '.join(f'{v:.3f}' for v in serving)})")  # fmt: skip
    for label, restored, base, bound, what in (
        ("node memory", r["recovery_memory_all"], memcpy, 1.5, "memcpy"),
        ("the peer", r["recovery_peer_all"], sock, 2.0, "socket copy"),
        ("the peer", r["recovery_peer_all"], serving, 2.0, "socket copy while the senders copy their own state"),
    ):
        ratio = statistics.median(a / b for a, b in zip(restored, base, strict=True))
        report.say(
            f"target: restore from {label} / {what} = {ratio:.2f}x (target <= {bound}): {verdict(ratio <= bound)}"
        )
    cpu_lines(report, r)
    for label in ("memory", "peer", "durable"):
        peaks = r.get(f"peak_{label}", [])
        if peaks:
            report.say(
                f"peak extra host memory, restore from {label}: {max(peaks) / r['restored_bytes']:.2f}x the "
                f"rank's restored state ({max(peaks) / MIB:.0f} MiB, largest rank; heap in use or new pages)"
            )


def cpu_lines(report: Report, r: dict) -> None:
    """The CPU time of the paths, and the least time the peer restore's work takes on this machine's cores."""
    if "cpu_peer_all" not in r:
        return
    cores = os.cpu_count() or 1
    med = statistics.median
    floor = med(c / cores / s for c, s in zip(r["cpu_peer_all"], r["recovery_socket_all"], strict=True))
    report.say(f"CPU time of all 4 ranks (user + system, median): restore from the peer {med(r['cpu_peer_all']):.2f} "
               f"CPU-s (the serving node's ranks {med(r['cpu_peer_serving_all']):.2f}: their own restore from memory "
               f"and the file servers), loopback socket copy {med(r['cpu_socket_all']):.2f}, restore from node memory "
               f"{med(r['cpu_memory_all']):.2f}; cores idle during the peer restore {med(r['idle_peer_all']):.2f} s "
               f"of {cores} x {r['recovery_peer_s']:.2f} s")  # fmt: skip
    report.say(f"  on this machine's {cores} cores the peer restore's work alone takes at least {floor:.2f}x the "
               "socket copy (its CPU time / cores / the socket copy's time)")  # fmt: skip


def recovery_lines(report: Report, r: dict, total_mib: int, repeats: int, mem_base: str) -> None:
    """The recovery rows, the targets and the blocked saves of the 4 ranks."""
    mem_s, peer_s, durable_s = r["recovery_memory_s"], r["recovery_peer_s"], r["recovery_durable_s"]
    each = lambda label: ", ".join(f"{v:.3f}" for v in r[f"recovery_{label}_all"])  # noqa: E731
    report.say(f"state: {total_mib} MiB in all, 4 ranks as 2 nodes; memory tier in {mem_base}")
    report.say(f"recovery (median of {repeats}, slowest rank):")
    report.say(f"recovery from node memory:   {mem_s:7.3f} s   ({r['recovery_memory_tiers']}; each: {each('memory')})")
    report.say(f"recovery from the peer:      {peer_s:7.3f} s   ({r['recovery_peer_tiers']}; each: {each('peer')})")
    report.say(f"recovery from durable, cold: {durable_s:7.3f} s   (page cache dropped by {r['cold_method']}; "
               f"each: {each('durable')})")  # fmt: skip
    report.say(f"  durable / memory = {durable_s / mem_s:.2f}x, durable / peer = {durable_s / peer_s:.2f}x")
    target_lines(report, r)
    plain, tiered = r["blocked_plain_s"], r["blocked_tier_s"]
    report.say(f"save blocked (async, median of {repeats}): without tier {plain:.3f} s, with tier {tiered:.3f} s "
               f"(ratio {tiered / plain:.2f})")  # fmt: skip
    for mode, values in r["blocked_all"].items():
        report.say(f"  blocked {mode}: " + ", ".join(f"{v:.3f}" for v in values))


def run(args: argparse.Namespace, report: Report) -> int:
    """The 4 ranks' run, then the one-process comparison."""
    sections = args.sections or list(SECTIONS)
    work = tempfile.mkdtemp(prefix="nxd_bench_tier_", dir=args.durable_dir)
    mem_base = "/dev/shm" if os.path.isdir("/dev/shm") else work
    mem = tempfile.mkdtemp(prefix="nxd_bench_tier_mem_", dir=mem_base)
    try:
        if "recovery" in sections:
            kwargs = {"total_mib": args.total_mib, "repeats": args.repeats, "ckpt": os.path.join(work, "ckpt"),
                      "mem": mem}  # fmt: skip
            r = report.data["recovery"] = on_ranks(rank_main, 4, kwargs, ranks_per_node=2)
            recovery_lines(report, r, args.total_mib, args.repeats, mem_base)
        if "single" in sections:
            single = report.data["single"] = single_process_blocked(args.total_mib // 4, args.repeats * 2, work)
            plain1, tier1 = statistics.median(single["plain"]), statistics.median(single["tier"])
            report.say(f"save blocked, one process ({args.total_mib // 4} MiB, replicas=0, median of "
                       f"{args.repeats * 2}): without tier {plain1:.3f} s, with tier {tier1:.3f} s (ratio "
                       f"{tier1 / plain1:.2f})")  # fmt: skip
            for mode, values in single.items():
                report.say(f"  blocked {mode}: " + ", ".join(f"{v:.3f}" for v in values))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    return 0
