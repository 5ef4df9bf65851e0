"""Memory tier benchmark: recovery time from node memory, from a peer node, and from durable storage
(cold), for the same state, and what the tiers add to the time a save blocks training.

Run:  $(bash scripts/setup_env.sh cpu | tail -1) scripts/bench_memory_tier.py [--total-mib 512] [--repeats 3]

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
Ratios are printed; absolute times vary 2-5x on this shared 2-core VM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned ranks import this file by name

from benchlib import CpuTime, PeakRSS, receive_exactly

MIB = 1 << 20


def _state(total_bytes: int, rank: int, world: int) -> tuple[dict, dict]:
    """A replicated fp32 model (a third of the bytes) and this rank's shard of AdamW's two moments."""
    n = max(1, total_bytes // 3 // 4 // 8)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.rand(n, generator=gen) for i in range(8)}
    shard = n // world
    state = {
        i: {"step": torch.tensor(5.0), "exp_avg": torch.rand(shard) + rank, "exp_avg_sq": torch.rand(shard)}
        for i in range(8)
    }
    return model, {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(8))}]}


def _drop_cache(root: str) -> str:
    """Evict the checkpoint's files from the page cache; return how."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) per file"


def _slowest(coord, seconds: float) -> float:
    return max(coord.all_gather_object(seconds, phase="benchmark"))


def blocked_saves(coord, ckpt: str, model: dict, optimizer: dict, tier, repeats: int) -> dict[str, list[float]]:
    """Async saves without and with the tier, alternating which goes first (the newest tag is a tier save):
    the slowest rank's blocked time of each."""
    import nxd_ckpt as nxd

    blocked: dict[str, list[float]] = {"plain": [], "tier": []}
    nxd.save_checkpoint(ckpt, "warmup_plain", model=model, optimizer=optimizer, zero1_optimizer=True,
                        async_save=True, num_kept_ckpts=2).wait()  # fmt: skip
    nxd.save_checkpoint(ckpt, "warmup_tier", model=model, optimizer=optimizer, zero1_optimizer=True,
                        async_save=True, num_kept_ckpts=2, memory_tier=tier).wait()  # fmt: skip
    for i in range(repeats):
        last_pair = (repeats - 1 - i) % 2 == 0  # alternate which goes first; the newest tag is a tier save
        for mode in ("plain", "tier") if last_pair else ("tier", "plain"):
            coord.barrier()
            report = nxd.save_checkpoint(
                ckpt, f"{mode}_{i}", model=model, optimizer=optimizer, zero1_optimizer=True, async_save=True,
                num_kept_ckpts=2, memory_tier=tier if mode == "tier" else None,
            )  # fmt: skip
            blocked[mode].append(_slowest(coord, report.blocked_s))
            report.wait()
            nxd.get_manager().wait_pending()  # retention too: the next save must not wait for anything
    return blocked


def rank_main(total_mib: int, repeats: int, ckpt: str, mem: str, out: str) -> None:
    import torch.distributed as dist

    import nxd_ckpt as nxd
    from nxd_ckpt.ranks.coordinator import Coordinator

    rank, world = dist.get_rank(), dist.get_world_size()
    coord = Coordinator()
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"  # simulated nodes on one machine meet on loopback
    tier = nxd.MemoryTier(
        dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=1, max_copies=4, bind="127.0.0.1"
    )
    model, optimizer = _state(total_mib * MIB, rank, world)
    blocked = blocked_saves(coord, ckpt, model, optimizer, tier, repeats)
    nxd.finalize_checkpoint()
    newest = f"tier_{repeats - 1}"
    results: dict[str, object] = {
        "blocked_plain_s": statistics.median(blocked["plain"]),
        "blocked_tier_s": statistics.median(blocked["tier"]),
        "blocked_all": blocked,
        "rank_bytes": sum(t.numel() * t.element_size() for t in optimizer_tensors(optimizer))
        + (sum(t.numel() * t.element_size() for t in model.values()) if rank == 0 else 0),
    }

    # The training state a resume loads into: allocated and touched (a built model, an initialised optimizer).
    target_model = {k: torch.zeros_like(v) for k, v in model.items()}
    target_opt = {
        "state": {i: {k: torch.zeros_like(v) for k, v in s.items()} for i, s in optimizer["state"].items()},
        "param_groups": [dict(g) for g in optimizer["param_groups"]],
    }
    read = [*model.values(), *optimizer_tensors(optimizer)]  # what each rank restores: the model and its shard
    results["restored_bytes"] = sum(t.numel() * t.element_size() for t in read)
    baselines: dict[str, list[float]] = {"memcpy": [], "socket": [], "socket_serving": []}
    profile = os.environ.get("NXD_BENCH_PROFILE")

    def count_cpu(label: str, cpu: CpuTime) -> None:
        """The CPU seconds of all ranks (and of the serving node's ranks) for one timed path, and the idle time."""
        used = coord.all_gather_object(cpu.used_s, phase="benchmark: CPU time")
        results.setdefault(f"cpu_{label}_all", []).append(sum(used))
        results.setdefault(f"cpu_{label}_serving_all", []).append(sum(used[world // 2 :]))
        results.setdefault(f"idle_{label}_all", []).append(cpu.machine_idle_s)

    def load_once(label: str, peak: PeakRSS | None) -> float:
        """One load by a fresh manager (the slowest rank's time), checked; with ``peak``, measured by it."""
        manager = nxd.CheckpointManager()
        for t in [*target_model.values(), *optimizer_tensors(target_opt)]:
            t.fill_(-1.0)  # scribbled: the load must bring every byte back
        coord.barrier()
        profiler = _profiler(profile, rank, label) if peak is None else contextlib.nullcontext()
        with peak or contextlib.nullcontext():
            start = time.perf_counter()
            with profiler, CpuTime() as cpu:
                manager.load(ckpt, model=target_model, optimizer=target_opt, memory_tier=tier)
            elapsed = _slowest(coord, time.perf_counter() - start)
        if peak is None and label != "warmup":
            count_cpu(label, cpu)
        restore = manager.last_restore
        assert restore is not None and restore.tag == newest, restore
        assert all(torch.equal(target_model[k], model[k]) for k in model)
        pairs = zip(optimizer_tensors(target_opt), optimizer_tensors(optimizer), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        results[f"recovery_{label}_tiers"] = restore.summary()
        manager.finalize()
        return elapsed

    def timed_load(label: str) -> float:
        """A timed load; the first of each path is followed by an untimed one measuring its peak memory (the
        sampler thread, every 2 ms, and the gc.collect of ``PeakRSS`` are kept out of the timed loads)."""
        elapsed = load_once(label, None)
        if label != "warmup" and f"peak_{label}" not in results:
            if label == "durable" and rank == 0:
                _drop_cache(ckpt)  # cold again (the load that follows waits for rank 0 at its barrier)
            peak = PeakRSS()
            load_once(label, peak)
            results[f"peak_{label}"] = [_slowest(coord, peak.extra)]
        return elapsed

    times: dict[str, list[float]] = {"memory": [], "peer": [], "durable": []}
    node0, node1 = os.path.join(mem, "node0"), os.path.join(mem, "node1")
    timed_load("warmup")  # first load of the processes (imports, allocator): not counted
    peers = {r: q for r in range(world) for q in range(world) if q == (r + world // 2) % world}
    for _ in range(repeats):
        baselines["memcpy"].append(_slowest(coord, memcpy_s(read, target_model, target_opt)))
        with CpuTime() as cpu:
            baselines["socket"].append(socket_copy_s(coord, read, rank, peers[rank], receiver=rank < world // 2))
        count_cpu("socket", cpu)
        baselines["socket_serving"].append(
            socket_copy_s(coord, read, rank, peers[rank], rank < world // 2,
                          own_copy=lambda: memcpy_s(read, target_model, target_opt))
        )  # fmt: skip
        times["memory"].append(timed_load("memory"))
        if rank == 0:
            os.rename(node0, node0 + ".lost")
        coord.barrier()
        times["peer"].append(timed_load("peer"))
        if rank == 0:
            os.rename(node1, node1 + ".lost")
            results["cold_method"] = _drop_cache(ckpt)
        coord.barrier()
        times["durable"].append(timed_load("durable"))
        if rank == 0:  # the replaced nodes' new (empty) memory directories give way to the saved ones
            for node_dir in (node0, node1):
                shutil.rmtree(node_dir, ignore_errors=True)
                os.rename(node_dir + ".lost", node_dir)
        coord.barrier()
    for label, values in [*times.items(), *baselines.items()]:
        results[f"recovery_{label}_s"] = statistics.median(values)
        results[f"recovery_{label}_all"] = values
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def memcpy_s(read: list[torch.Tensor], target_model: dict, target_opt: dict) -> float:
    """This rank's time to copy the bytes it restores into the (touched) tensors a restore fills."""
    dests = [*target_model.values(), *optimizer_tensors(target_opt)]
    start = time.perf_counter()
    with torch.no_grad():
        for dst, src in zip(dests, read, strict=True):
            dst.copy_(src)
    return time.perf_counter() - start


def socket_copy_s(
    coord, read: list[torch.Tensor], rank: int, peer: int, receiver: bool, own_copy: Callable[[], object] | None = None
) -> float:
    """The peer restore's baseline: the ranks of node 0 receive the bytes they restore from their peer on node
    1 over one loopback TCP connection (sendall of the tensors, recv_into touched buffers), all pairs at once;
    the slowest receiver's time. With ``own_copy``, each sender runs it (its own state's memcpy) while a thread
    sends, as a serving rank of the peer restore restores its own state while its file server sends."""
    import socket
    import threading

    nbytes = sum(t.numel() * t.element_size() for t in read)
    listener = None
    port = 0
    if receiver:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    ports = coord.all_gather_object(port, phase="benchmark: socket baseline")
    elapsed = 0.0
    if receiver:
        assert listener is not None
        into = _socket_buffer(nbytes)
        view = memoryview(into.numpy())
        coord.barrier()
        conn, _ = listener.accept()
        start = time.perf_counter()
        with conn:
            receive_exactly(conn, view, nbytes)
        elapsed = time.perf_counter() - start
        listener.close()
    else:
        coord.barrier()

        def send() -> None:
            with socket.create_connection(("127.0.0.1", ports[peer])) as conn:
                for t in read:
                    conn.sendall(memoryview(t.numpy()).cast("B"))

        sender = threading.Thread(target=send)
        sender.start()
        if own_copy is not None:
            own_copy()
        sender.join()
    return max(coord.all_gather_object(elapsed, phase="benchmark: socket baseline"))


_SOCKET_BUFFER: list[torch.Tensor] = []


def _socket_buffer(nbytes: int) -> torch.Tensor:
    """A receive buffer allocated and touched once (the restore's targets are touched too)."""
    if not _SOCKET_BUFFER or _SOCKET_BUFFER[0].numel() != nbytes:
        _SOCKET_BUFFER[:] = [torch.ones(nbytes, dtype=torch.uint8)]
    return _SOCKET_BUFFER[0]


def _profiler(directory: str | None, rank: int, label: str):
    """cProfile of rank 0's timed memory and peer restores into ``directory`` (NXD_BENCH_PROFILE), else nothing."""
    import contextlib

    if not directory or rank != 0 or label not in ("memory", "peer"):
        return contextlib.nullcontext()
    import cProfile

    @contextlib.contextmanager
    def run():
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(directory, f"{label}_{time.time_ns()}.prof"))

    return run()


def single_process_blocked(total_mib: int, repeats: int, work: str) -> dict[str, list[float]]:
    """The same comparison in this one process (``replicas=0``): the training thread's own cost of the tier,
    without 4 ranks competing for 2 cores."""
    import nxd_ckpt as nxd

    model, _ = _state(total_mib * MIB, 0, 1)
    ckpt, mem = os.path.join(work, "single"), os.path.join(work, "single_mem")
    tier = nxd.MemoryTier(dir=mem, replicas=0, durable_every=1, max_copies=2)
    out: dict[str, list[float]] = {"plain": [], "tier": []}
    for i in range(repeats + 1):
        for mode in ("plain", "tier") if i % 2 == 0 else ("tier", "plain"):
            report = nxd.save_checkpoint(
                ckpt, f"{mode}_{i}", model=model, async_save=True, num_kept_ckpts=2,
                memory_tier=tier if mode == "tier" else None,
            )  # fmt: skip
            if i:  # the first round allocates the staging buffers
                out[mode].append(report.blocked_s)
            report.wait()
            nxd.get_manager().wait_pending()
    nxd.reset_manager()
    return out


def print_targets(r: dict, total_mib: int) -> None:
    """The memory-tier targets, each ratio paired within one repetition (medians of the pairs)."""
    per_rank = r["restored_bytes"] / MIB
    memcpy, sock, serving = r["recovery_memcpy_all"], r["recovery_socket_all"], r["recovery_socket_serving_all"]
    mem_ratio = statistics.median(a / b for a, b in zip(r["recovery_memory_all"], memcpy, strict=True))
    peer_ratio = statistics.median(a / b for a, b in zip(r["recovery_peer_all"], sock, strict=True))
    serving_ratio = statistics.median(a / b for a, b in zip(r["recovery_peer_all"], serving, strict=True))
    print(f"baselines per rank ({per_rank:.0f} MiB restored by each): memcpy into the touched targets "
          f"{r['recovery_memcpy_s']:.3f} s (each: {', '.join(f'{v:.3f}' for v in memcpy)}); loopback socket copy "
          f"{r['recovery_socket_s']:.3f} s (each: {', '.join(f'{v:.3f}' for v in sock)}); the same socket copy "
          f"while each sender copies its own state {r['recovery_socket_serving_s']:.3f} s "
          f"(each: {', '.join(f'{v:.3f}' for v in serving)})")  # fmt: skip
    for label, ratio, bound, base in (
        ("node memory", mem_ratio, 1.5, "memcpy"),
        ("the peer", peer_ratio, 2.0, "socket copy"),
        ("the peer", serving_ratio, 2.0, "socket copy while the senders copy their own state"),
    ):
        verdict = "MET" if ratio <= bound else "NOT MET"
        print(f"target: restore from {label} / {base} = {ratio:.2f}x (target <= {bound}): {verdict}")
    if "cpu_peer_all" in r:
        cores = os.cpu_count() or 1
        peer_cpu, socket_cpu = statistics.median(r["cpu_peer_all"]), statistics.median(r["cpu_socket_all"])
        floor = statistics.median(c / cores / s for c, s in zip(r["cpu_peer_all"], sock, strict=True))
        print(f"CPU time of all 4 ranks (user + system, median): restore from the peer {peer_cpu:.2f} CPU-s (the "
              f"serving node's ranks {statistics.median(r['cpu_peer_serving_all']):.2f}: their own restore from "
              f"memory and the file servers), loopback socket copy {socket_cpu:.2f}, restore from node memory "
              f"{statistics.median(r['cpu_memory_all']):.2f}; cores idle during the peer restore "
              f"{statistics.median(r['idle_peer_all']):.2f} s of {cores} x "
              f"{r['recovery_peer_s']:.2f} s")  # fmt: skip
        print(f"  on this machine's {cores} cores the peer restore's work alone takes at least {floor:.2f}x the "
              "socket copy (its CPU time / cores / the socket copy's time)")  # fmt: skip
    for label in ("memory", "peer", "durable"):
        peaks = r.get(f"peak_{label}", [])
        if peaks:
            print(f"peak extra host memory, restore from {label}: {max(peaks) / r['restored_bytes']:.2f}x the rank's "
                  f"restored state ({max(peaks) / MIB:.0f} MiB, largest rank; heap in use or new pages)")  # fmt: skip


def optimizer_tensors(optimizer: dict) -> list[torch.Tensor]:
    return [t for s in optimizer["state"].values() for t in s.values() if t.dim() > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=512, help="tensor data of the whole job")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable-dir", default=None, help="where the checkpoint directory goes (default: a temp dir)")
    args = parser.parse_args()
    from harness.multiprocess import run_on_ranks

    bench = __import__("bench_memory_tier")  # by module name, as the spawned ranks import it

    work = tempfile.mkdtemp(prefix="nxd_bench_tier_", dir=args.durable_dir)
    mem_base = "/dev/shm" if os.path.isdir("/dev/shm") else work
    mem = tempfile.mkdtemp(prefix="nxd_bench_tier_mem_", dir=mem_base)
    out = os.path.join(work, "results.json")
    try:
        run_on_ranks(
            bench.rank_main, 4, dict(total_mib=args.total_mib, repeats=args.repeats, ckpt=os.path.join(work, "ckpt"),
                               mem=mem, out=out),
            timeout=1800, ranks_per_node=2,
        )  # fmt: skip
        with open(out) as f:
            r = json.load(f)
        single = single_process_blocked(args.total_mib // 4, args.repeats * 2, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    mem_s, peer_s, durable_s = r["recovery_memory_s"], r["recovery_peer_s"], r["recovery_durable_s"]
    print(f"state: {args.total_mib} MiB in all, 4 ranks as 2 nodes; memory tier in {mem_base}")
    print(f"recovery (median of {args.repeats}, slowest rank):")

    def each(label: str) -> str:
        return ", ".join(f"{v:.3f}" for v in r[f"recovery_{label}_all"])

    print(f"recovery from node memory:   {mem_s:7.3f} s   ({r['recovery_memory_tiers']}; each: {each('memory')})")
    print(f"recovery from the peer:      {peer_s:7.3f} s   ({r['recovery_peer_tiers']}; each: {each('peer')})")
    print(f"recovery from durable, cold: {durable_s:7.3f} s   (page cache dropped by {r['cold_method']}; "
          f"each: {each('durable')})")  # fmt: skip
    print(f"  durable / memory = {durable_s / mem_s:.2f}x, durable / peer = {durable_s / peer_s:.2f}x")
    print_targets(r, args.total_mib)
    plain, tiered = r["blocked_plain_s"], r["blocked_tier_s"]
    print(f"save blocked (async, median of {args.repeats}): without tier {plain:.3f} s, with tier {tiered:.3f} s "
          f"(ratio {tiered / plain:.2f})")  # fmt: skip
    for mode, values in r["blocked_all"].items():
        print(f"  blocked {mode}: " + ", ".join(f"{v:.3f}" for v in values))
    plain1, tier1 = statistics.median(single["plain"]), statistics.median(single["tier"])
    print(f"save blocked, one process ({args.total_mib // 4} MiB, replicas=0, median of {args.repeats * 2}): "
          f"without tier {plain1:.3f} s, with tier {tier1:.3f} s (ratio {tier1 / plain1:.2f})")  # fmt: skip
    for mode, values in single.items():
        print(f"  blocked {mode}: " + ", ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
