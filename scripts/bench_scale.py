#!/usr/bin/env python3
"""Scale benchmark: what one save, async save, load and ``latest`` cost per rank at 16 to 4,096 ranks.

Ranks run as threads of this process (``testing.threadworld.ThreadWorld``: collectives at a condition variable,
the c10d store a real TCPStore on 127.0.0.1, one connection per rank), each with its own ``CheckpointManager``, a
Llama-70B-like layout (TP=32, PP=8, DP=N/256 at N >= 256; smaller worlds shrink PP, then TP) and a state of tiny
tensors with the names and count of a 70B stage (``--layers`` transformer layers split over PP; ZeRO-1 optimizer
shards on every rank), sized so that, as at 70B, norm weights stay inside the xser reference files and every
matrix gets a file of its own (one object per tensor: NxD's layout). Storage is a directory on tmpfs seen through
``testing.counting.RequestCountingStorage``, which counts the S3 requests each call would make, by kind and by
key prefix.

Reported per operation and world size (a row each):
- store operations per rank (mean and max; "wait" = blocking waits on the rank's own connection);
- collectives per rank and bytes a rank receives (as gloo would carry the pickled objects);
- coordination wall time: for each cross-rank step, from the moment the last rank arrived until the last rank
  left it, summed over the steps (and the commit), so the time the simulated ranks spend on their own work
  (serialisation, on a shared GIL) is not counted;
- files, bytes and S3 requests (PUT/GET/HEAD/LIST/POST/DELETE), the busiest key prefix, and the time those
  requests take at S3's per-prefix rates (3,500 PUT/POST/DELETE, 5,500 GET/HEAD per second per partitioned
  prefix), for the busiest prefix and for the whole tag under one prefix (a new bucket, not yet partitioned).

``--processes P`` also runs the save on P real gloo processes (``harness.multiprocess``) to check the store
figures against real torch.distributed.

    python scripts/bench_scale.py --quick              # 16..256 ranks: a smoke run (minutes)
    python scripts/bench_scale.py --json scale.json    # 16..4,096 ranks, 8 layers (one per PP stage at >= 256
                                                       # ranks): the rows of docs/scale.md (an idle machine)
    python scripts/bench_scale.py --ranks 1024 --layers 80   # 70B's file count per rank (long: files dominate)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from nxd_ckpt.format import tags  # noqa: E402
from nxd_ckpt.manager import CheckpointManager  # noqa: E402
from nxd_ckpt.ranks.topology import Topology  # noqa: E402
from nxd_ckpt.save import barrier as commit_barrier  # noqa: E402
from nxd_ckpt.storage import LocalStorage  # noqa: E402
from nxd_ckpt.testing.counting import RequestCountingStorage  # noqa: E402
from nxd_ckpt.testing.threadworld import ThreadCoordinator, ThreadWorld  # noqa: E402

PUT_RATE, GET_RATE = 3500.0, 5500.0
"""S3 requests per second per partitioned prefix: PUT/COPY/POST/DELETE, and GET/HEAD."""
WRITE_KINDS, READ_KINDS = ("PUT", "POST", "DELETE", "RENAME"), ("GET", "HEAD", "LIST")
RANKS_PER_NODE = 32


# --------------------------------------------------------------------------------------------- the workload
def layout_for(n: int) -> tuple[int, int, int]:
    """(TP, PP, DP) of the 70B-like layout at ``n`` ranks: TP=32, PP=8 as far as ``n`` allows, DP the rest."""
    tp = min(32, n)
    pp = min(8, max(1, n // tp))
    return tp, pp, n // (tp * pp)


def stage_state(topo: Topology, layers: int, elems: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model shard and ZeRO-1 optimizer shard of one rank: a 70B stage's tensor names, ``elems`` each."""
    pp_rank = topo.pp_rank
    per_stage = max(1, layers // topo.pp_size)
    names = []
    if pp_rank == 0:
        names.append("model.embed_tokens.weight")
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"model.layers.{layer}.self_attn.{part}.weight")
        for part in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"model.layers.{layer}.mlp.{part}.weight")
        names += [
            f"model.layers.{layer}.input_layernorm.weight",
            f"model.layers.{layer}.post_attention_layernorm.weight",
        ]
    if pp_rank == topo.pp_size - 1:
        names += ["model.norm.weight", "lm_head.weight"]
    sizes = [elems // 2 if name.endswith("norm.weight") else elems * 2 for name in names]
    model = {name: torch.zeros(n) for name, n in zip(names, sizes, strict=True)}
    base = {i: {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)} for i, n in enumerate(sizes)}
    optimizer = {"base_state": base, "shape_info": {i: torch.Size([n * topo.dp_size]) for i, n in enumerate(sizes)}}
    return model, optimizer


def inline_bytes(elems: int) -> int:
    """The xser inline threshold that keeps the (tiny) norm weights inside the reference files and gives every
    matrix a file of its own, as the real sizes do at 70B (norms 16 KiB, matrix shards MiBs; threshold 64 KiB)."""
    return elems * 4


# --------------------------------------------------------------------------------------------- instrumentation
class _Clock:
    """Arrival and departure times of every rank at every cross-rank step (and at the commit)."""

    def __init__(self, size: int) -> None:
        self.arrive: list[list[float]] = [[] for _ in range(size)]
        self.leave: list[list[float]] = [[] for _ in range(size)]
        self.woke: list[list[float]] = [[] for _ in range(size)]
        """When each rank's store wait at each step returned (node barriers: when it left them)."""
        self.cpu: list[list[tuple[float, float]]] = [[] for _ in range(size)]
        """Each rank's own CPU time (``time.thread_time``) at its wake-up and at its departure, per step."""
        self.commit: dict[tuple[int, int], dict[str, float]] = {}
        self.world_steps = 0
        """Store-gated steps of the whole world (rank 0 counts them): each ends with the store releasing N ranks."""
        self._lock = threading.Lock()

    def reset(self) -> None:
        for lst in (*self.arrive, *self.leave, *self.woke, *self.cpu):
            lst.clear()
        self.commit.clear()
        self.world_steps = 0

    def releases(self) -> int:
        """Times the store released every rank: the world-wide steps and each commit's outcome."""
        return self.world_steps + len({seq for seq, _ in self.commit})

    def mark(self, seq: int, rank: int, event: str) -> None:
        with self._lock:
            self.commit.setdefault((seq, rank), {})[event] = time.perf_counter()

    def parallel_s(self) -> float:
        """The critical path with the ranks' own work after each release run in parallel, as a job runs it:
        per step, from the last arrival to the first rank's wake-up (the store's work), plus the largest CPU
        time one rank spent between its wake-up and its departure (its own Python and the collective's), not
        the time it queued for this process's GIL behind the other rank threads; plus the commit as in
        ``coordination_s``."""
        steps = min(len(c) for c in self.cpu) if self.cpu else 0
        total = 0.0
        for k in range(steps):
            last_in = max(a[k] for a in self.arrive)
            total += max(0.0, min(w[k] for w in self.woke) - last_in)
            total += max(c[k][1] - c[k][0] for c in self.cpu)
        return total + self._commit_s()[1]

    def _commit_s(self) -> tuple[float, float]:
        """The commits' coordination: (to the last rank knowing the outcome, to the first one knowing it)."""
        total = critical = 0.0
        for seq in sorted({s for s, _ in self.commit}):
            marks = {r: m for (s, r), m in self.commit.items() if s == seq}
            arrived = [m["arrived"] for m in marks.values() if "arrived" in m]
            master = marks.get(0, {})
            if arrived and "all_arrived" in master:
                gathered = max(0.0, master["all_arrived"] - max(arrived))
                total, critical = total + gathered, critical + gathered
            outcome = [m["outcome"] for m in marks.values() if "outcome" in m]
            if outcome and "published" in master:
                total += max(0.0, max(outcome) - master["published"])
                critical += max(0.0, min(outcome) - master["published"])
        return total, critical

    def coordination_s(self) -> tuple[float, float, int]:
        """(seconds from each step's last arrival to its last departure, summed with the commit's; the same to
        each step's first departure, the critical path; steps).

        The first is what the simulation shows; the second leaves out the time the simulated ranks wait for one
        another on this machine's cores and GIL once they are released (a job's ranks resume in parallel)."""
        steps = min(len(a) for a in self.arrive) if self.arrive else 0
        total = critical = 0.0
        for k in range(steps):
            last_in = max(a[k] for a in self.arrive)
            total += max(0.0, max(lv[k] for lv in self.leave) - last_in)
            critical += max(0.0, min(lv[k] for lv in self.leave) - last_in)
        commit_total, commit_critical = self._commit_s()
        total, critical = total + commit_total, critical + commit_critical
        return total, critical, steps


class TimedCoordinator(ThreadCoordinator):
    """A ThreadWorld rank that records when it arrives at and leaves every cross-rank step."""

    clock: _Clock

    def _arrive_and_wait(self, phase: str) -> None:
        self.clock.arrive[self.rank].append(time.perf_counter())
        if self.rank == 0:
            self.clock.world_steps += 1
        super()._arrive_and_wait(phase)
        self.clock.woke[self.rank].append(time.perf_counter())
        self._cpu_woke = time.thread_time()

    def _node_barrier(self, local_rank: int, local_world_size: int, phase: str) -> None:
        """A node's wave barrier counts as a step too (timed from the last arrival anywhere: conservative)."""
        self.clock.arrive[self.rank].append(time.perf_counter())
        super()._node_barrier(local_rank, local_world_size, phase)
        now, cpu = time.perf_counter(), time.thread_time()
        self.clock.leave[self.rank].append(now)
        self.clock.woke[self.rank].append(now)
        self.clock.cpu[self.rank].append((cpu, cpu))


def _timed_leave(name: str) -> Callable[..., Any]:
    real = getattr(ThreadCoordinator, name)

    def method(self: TimedCoordinator, *args: Any, **kwargs: Any) -> Any:
        try:
            return real(self, *args, **kwargs)
        finally:
            if self.distributed and len(self.clock.leave[self.rank]) < len(self.clock.arrive[self.rank]):
                self.clock.leave[self.rank].append(time.perf_counter())
                cpu = time.thread_time()
                self.clock.cpu[self.rank].append((getattr(self, "_cpu_woke", cpu), cpu))

    return method


for _name in (
    "master_computes", "master_computes_and_scatters", "gather_to_master_and_master_computes",
    "gather_and_master_computes", "run_all", "barrier", "all_gather_object", "broadcast_object",
    "gather_object", "scatter_object",
):  # fmt: skip
    setattr(TimedCoordinator, _name, _timed_leave(_name))


def _instrument_commit(clock: _Clock) -> None:
    """Record the commit's arrivals, rank 0's 'all arrived' and 'published', and each rank's 'outcome known'."""
    barrier = commit_barrier.CommitBarrier

    def wrap(name: str, before: str | None, after: str | None) -> None:
        real = getattr(barrier, name)

        def method(self: commit_barrier.CommitBarrier, *args: Any, **kwargs: Any) -> Any:
            if before:
                clock.mark(self.seq, self.rank, before)
            result = real(self, *args, **kwargs)
            if after:
                clock.mark(self.seq, self.rank, after)
            return result

        setattr(barrier, name, method)

    wrap("arrive", "arrived", None)
    wrap("wait_all_arrived", None, "all_arrived")
    wrap("publish_outcome", "published", None)
    wrap("wait_outcome", None, "outcome")


# --------------------------------------------------------------------------------------------- one world
class World:
    """``n`` thread ranks, their managers and the counting storage of one checkpoint directory."""

    def __init__(self, n: int, root: str, layers: int, elems: int, clock: _Clock, store: Any) -> None:
        self.n = n
        self.tp, self.pp, self.dp = layout_for(n)
        self.world = ThreadWorld(n, timeout_s=1800.0, count=True, store=store)
        self.clock = clock
        self.storage = RequestCountingStorage(LocalStorage(root))
        shared = Topology(tp_size=self.tp, pp_size=self.pp, dp_size=self.dp)  # groups built once, for every rank
        self.topos = [
            Topology(
                tp_size=self.tp,
                pp_size=self.pp,
                dp_size=self.dp,
                rank=r,
                local_rank=r % min(n, RANKS_PER_NODE),
                local_world_size=min(n, RANKS_PER_NODE),
                groups=shared.groups,
            )
            for r in range(n)
        ]
        self.managers = []
        for r in range(n):
            coord = TimedCoordinator(self.world, r)
            coord.clock = clock
            self.managers.append(CheckpointManager(coordinator=coord, topology=self.topos[r], storage=self._storage))
        self.states = [stage_state(t, layers, elems) for t in self.topos]

    def _storage(self, _directory: Any) -> RequestCountingStorage:
        return self.storage

    def measure(self, what: str, fn: Callable[[int], Any]) -> dict[str, Any]:
        """Run ``fn(rank)`` on every rank and return the figures of that one operation."""
        self.clock.reset()
        self.storage.reset()
        ops_before = [t.total() for t in self.world.tallies]
        wait_before = [t.total("waiting") for t in self.world.tallies]
        coll_before = [{k: list(v) for k, v in c.items()} for c in self.world.collectives]
        start = time.perf_counter()
        self.world.run(fn)
        wall = time.perf_counter() - start
        ops = [t.total() - b for t, b in zip(self.world.tallies, ops_before, strict=True)]
        waits = [t.total("waiting") - b for t, b in zip(self.world.tallies, wait_before, strict=True)]
        calls, received = [], []
        for now, before in zip(self.world.collectives, coll_before, strict=True):
            calls.append(sum(v[0] - before.get(k, [0, 0])[0] for k, v in now.items()))
            received.append(sum(v[1] - before.get(k, [0, 0])[1] for k, v in now.items()))
        coordination, critical, steps = self.clock.coordination_s()
        return {
            "op": what,
            "ranks": self.n,
            "layout": f"TP{self.tp} PP{self.pp} DP{self.dp}",
            "wall_s": wall,
            "coordination_s": coordination,
            "critical_s": critical,
            "parallel_s": self.clock.parallel_s(),
            "releases": self.clock.releases(),
            "steps": steps,
            "store_ops_mean": statistics.fmean(ops),
            "store_ops_max": max(ops),
            "store_wait_ops_max": max(waits),
            "collectives_max": max(calls),
            "recv_bytes_max": max(received),
            **_requests(self.storage),
        }


def _requests(storage: RequestCountingStorage) -> dict[str, Any]:
    """Files, bytes and requests of one operation, and their time at S3's per-prefix rates."""
    by_prefix = storage.by_prefix

    def seconds(counts: dict[str, int]) -> float:
        writes = sum(n for k, n in counts.items() if k in WRITE_KINDS)
        reads = sum(n for k, n in counts.items() if k in READ_KINDS)
        return writes / PUT_RATE + reads / GET_RATE

    busiest = max(by_prefix.items(), key=lambda kv: sum(kv[1].values()), default=("-", {}))
    return {
        "files": storage.files_written,
        "bytes": storage.bytes_written,
        "requests": dict(sorted(storage.requests.items())),
        "busiest_prefix": busiest[0],
        "busiest_prefix_requests": sum(busiest[1].values()),
        "s3_s_busiest_prefix": seconds(busiest[1]),
        "s3_s_one_prefix": seconds(storage.requests),
    }


def run_world(
    n: int, layers: int, elems: int, ops: list[str], root: str, num_workers: int, release_s: float
) -> list[dict[str, Any]]:
    """Every operation of ``ops`` on an ``n``-rank world: a row each (``release_s``: ``store_release_s(n)``)."""
    clock = _Clock(n)
    _instrument_commit(clock)
    with StoreProcess() as store:
        return _run_world(n, layers, elems, ops, root, num_workers, release_s, clock, store)


def _run_world(
    n: int, layers: int, elems: int, ops: list[str], root: str, num_workers: int, release_s: float, clock: _Clock,
    store: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    start = time.perf_counter()
    world = World(n, os.path.join(root, f"w{n}"), layers, elems, clock, store)
    print(f"  {n} ranks: world set up in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        row["release_s"] = release_s
        row["projected_s"] = row["critical_s"] + row["releases"] * release_s
        row["parallel_projected_s"] = row["parallel_s"] + row["releases"] * release_s
        print_row(row)
        rows.append(row)

    managers, states = world.managers, world.states
    directory = os.path.join(root, f"w{n}")

    def save(tag: str, async_save: bool) -> Callable[[int], None]:
        def fn(rank: int) -> None:
            model, optimizer = states[rank]
            managers[rank].save(
                directory, tag, model=model, optimizer=optimizer, zero1_optimizer=True, num_workers=num_workers,
                async_save=async_save, use_xser=True,
            )  # fmt: skip
            managers[rank].finalize()

        return fn

    record(world.measure("first save", save("s0", False)))  # + one-time setup: sessions, wait connections
    if "save" in ops:
        record(world.measure("save", save("s1", False)))
    if "async" in ops:
        world.measure("first async save", save("a0", True))  # the writer threads' one-time setup
        record(world.measure("async save", save("s2", True)))
    if "load" in ops:

        def load(rank: int) -> None:
            model, optimizer = states[rank]
            managers[rank].load(directory, None, model=model, optimizer=optimizer, num_workers=num_workers)

        try:
            record(world.measure("load", load))
        except NotImplementedError as e:
            print(f"  load at {n} ranks not simulated: {e}", file=sys.stderr)
    if "latest" in ops:
        record(world.measure("latest", lambda rank: tags.latest_tag(world.storage) if rank == 0 else None))
    world.world.close()
    shutil.rmtree(directory, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------------------------- processes
def process_rank(layers: int, elems: int, directory: str, out_dir: str) -> None:
    """One rank of ``--processes``: a real gloo rank (``harness.multiprocess``) saving twice; its store operations
    of the second save (counted by wrapping the store the coordinator uses) go to ``out_dir/<rank>.json``."""
    import torch.distributed as dist

    from nxd_ckpt.ranks import coordinator
    from nxd_ckpt.testing.counting import CountingStore, StoreTally

    tally, wrapped = StoreTally(), {}
    real_store = coordinator.Coordinator.store.fget

    def counted_store(self: coordinator.Coordinator) -> Any:
        store = real_store(self)
        if store is not None and id(store) not in wrapped:
            wrapped[id(store)] = CountingStore(store, tally)
        return None if store is None else wrapped[id(store)]

    coordinator.Coordinator.store = property(counted_store)  # instrumentation of this benchmark process only
    rank, n = dist.get_rank(), dist.get_world_size()
    tp, pp, dp = layout_for(n)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    topo = Topology(tp, pp, dp, rank=rank, local_rank=rank % per_node, local_world_size=per_node)
    model, optimizer = stage_state(topo, layers, elems)
    manager = CheckpointManager(topology=topo)
    manager.save(directory, "p0", model=model, optimizer=optimizer, zero1_optimizer=True, use_xser=True)
    before, waits, start = tally.total(), tally.total("waiting"), time.perf_counter()
    manager.save(directory, "p1", model=model, optimizer=optimizer, zero1_optimizer=True, use_xser=True)
    figures = {"ops": tally.total() - before, "waits": tally.total("waiting") - waits}
    figures["save_s"] = time.perf_counter() - start
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(figures, f)


def run_processes(n: int, layers: int, elems: int, root: str) -> dict[str, Any]:
    """The save on ``n`` spawned gloo ranks (32 per simulated node): store operations per rank, save time."""
    from harness.multiprocess import run_on_ranks

    out_dir = tempfile.mkdtemp(dir=root)
    kwargs = {"layers": layers, "elems": elems, "directory": os.path.join(root, f"p{n}"), "out_dir": out_dir}
    env = {"NXD_CKPT_XSER_INLINE_BYTES": str(inline_bytes(elems)), "OMP_NUM_THREADS": "1"}
    run_on_ranks(process_rank, n, kwargs, timeout=1800, env=env, ranks_per_node=min(n, RANKS_PER_NODE))
    rows = []
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            rows.append(json.load(f))
    ops = [r["ops"] for r in rows]
    return {
        "ranks": n,
        "store_ops_mean": statistics.fmean(ops),
        "store_ops_max": max(ops),
        "store_wait_ops_max": max(r["waits"] for r in rows),
        "save_s_max": max(r["save_s"] for r in rows),
    }


# --------------------------------------------------------------------------------------------- store release
def release_waiters(port: int, n: int, rounds: int) -> None:
    """The child of ``store_release_s``: ``n`` connections, each waiting on a thread for each round's key."""
    import datetime

    import torch.distributed as dist

    from nxd_ckpt.testing.threadworld import connect

    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {os.cpu_count() - 1})  # the other core: the server keeps its own
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
    clients = connect(base, n)
    for k in range(rounds):

        def wait(client: Any, k: int = k) -> None:
            client.add(f"ready/{k}", 1)
            client.wait([f"go/{k}"], datetime.timedelta(seconds=600))

        threads = [threading.Thread(target=wait, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def store_release_s(n: int, rounds: int = 3) -> float:
    """Seconds the store takes to release ``n`` waiting ranks (median of ``rounds``): from the ``set`` of the key
    they wait for until the reply to the setter's next request, which the store's one event loop serves after
    it has sent every waiter its wake-up. The waiters are threads of a child process on the other core, so the
    server's work is timed, not the waiters' (a job's ranks wake on their own nodes)."""
    import subprocess

    from nxd_ckpt.ranks.coordinator import local_store

    cpus = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {0})  # the store's server thread, made now, inherits this core
    try:
        store = local_store(600.0)
    finally:
        os.sched_setaffinity(0, cpus)
    child = subprocess.Popen([sys.executable, __file__, "--release-waiters", str(store.port), str(n), str(rounds)])
    times = []
    try:
        for k in range(rounds):
            deadline = time.monotonic() + 600
            while int(store.add(f"ready/{k}", 0)) < n:
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {n} waiting connections did not come up (child exit {child.poll()})")
                time.sleep(0.05)
            time.sleep(0.5)  # every waiter is inside its wait
            start = time.perf_counter()
            store.set(f"go/{k}", b"1")
            store.add("probe", 0)
            times.append(time.perf_counter() - start)
        child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    return statistics.median(times)


def serve_store() -> None:
    """The child of ``StoreProcess``: a TCPStore server; prints its port, serves until its stdin closes."""
    from nxd_ckpt.ranks.coordinator import local_store

    store = local_store(1800.0)
    print(store.port, flush=True)
    sys.stdin.read()


class StoreProcess:
    """A TCPStore served by a child process (a job's store runs on one node, not inside every rank), and a
    client of it: at 4,096 thread ranks, three connections per rank (its own, its waiting one, its writer's)
    are 12,288 sockets here, and the server's ends would double that past the open-file limit."""

    def __enter__(self) -> Any:
        import datetime
        import subprocess

        import torch.distributed as dist

        self.child = subprocess.Popen(
            [sys.executable, __file__, "--serve-store"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.child.stdout.readline() if self.child.stdout else ""
        if not line.strip().isdigit():
            self.child.kill()
            raise RuntimeError(f"the store process did not start (it printed {line!r})")
        return dist.TCPStore("127.0.0.1", int(line), is_master=False, timeout=datetime.timedelta(seconds=1800))

    def __exit__(self, *exc: Any) -> None:
        if self.child.stdin:
            self.child.stdin.close()
        try:
            self.child.wait(timeout=30)
        except Exception:
            self.child.kill()


# --------------------------------------------------------------------------------------------- output
COLUMNS = [
    ("op", "{:<10}"),
    ("ranks", "{:>5}"),
    ("layout", "{:<14}"),
    ("coordination_s", "{:>7.3f}"),
    ("critical_s", "{:>7.3f}"),
    ("releases", "{:>3}"),
    ("projected_s", "{:>7.3f}"),
    ("parallel_s", "{:>7.3f}"),
    ("parallel_projected_s", "{:>7.3f}"),
    ("steps", "{:>3}"),
    ("store_ops_mean", "{:>6.1f}"),
    ("store_ops_max", "{:>5}"),
    ("store_wait_ops_max", "{:>4}"),
    ("collectives_max", "{:>4}"),
    ("recv_bytes_max", "{:>9}"),
    ("files", "{:>8}"),
    ("busiest_prefix_requests", "{:>8}"),
    ("s3_s_busiest_prefix", "{:>7.2f}"),
    ("s3_s_one_prefix", "{:>7.2f}"),
    ("wall_s", "{:>7.1f}"),
]
HEADERS = {
    "coordination_s": "coord s",
    "critical_s": "crit s",
    "releases": "rel",
    "projected_s": "proj s",
    "parallel_s": "par s",
    "parallel_projected_s": "ppar s",
    "steps": "stp",
    "store_ops_mean": "st.ops",
    "store_ops_max": "max",
    "store_wait_ops_max": "wait",
    "collectives_max": "coll",
    "recv_bytes_max": "recv B",
    "busiest_prefix_requests": "req/pfx",
    "s3_s_busiest_prefix": "S3 s/pfx",
    "s3_s_one_prefix": "S3 s/1pfx",
    "wall_s": "wall s",
}


def print_header() -> None:
    print(" | ".join(HEADERS.get(k, k) for k, _ in COLUMNS), flush=True)


def print_row(row: dict[str, Any]) -> None:
    """One row, as soon as it is measured (a long run stopped part-way keeps what it measured)."""
    print(" | ".join(fmt.format(row[k]) for k, fmt in COLUMNS), flush=True)


def print_requests(rows: list[dict[str, Any]]) -> None:
    print("\nrequests by kind (per operation):")
    for row in rows:
        print(f"  {row['op']:<10} {row['ranks']:>5} ranks: {row['requests']}  busiest prefix {row['busiest_prefix']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--release-waiters"]:  # the child process of store_release_s
        release_waiters(*map(int, argv[1:4]))
        return 0
    if argv[:1] == ["--serve-store"]:  # the child process of StoreProcess
        serve_store()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    parser.add_argument(
        "--layers", type=int, default=8, help="transformer layers of the model (70B: 80; 8 = one per PP stage)"
    )
    parser.add_argument("--elems", type=int, default=16, help="elements of every (tiny) tensor")
    parser.add_argument("--num-workers", type=int, default=8, help="ranks of a node writing at once (NxD's)")
    parser.add_argument("--ops", nargs="+", default=["save", "async", "load", "latest"])
    parser.add_argument("--quick", action="store_true", help="16..256 ranks, 8 layers: a smoke run")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--processes", type=int, nargs="*", default=[], help="also save on this many gloo ranks")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks = [n for n in args.ranks if n <= 256] or [16, 64]
        args.layers = min(args.layers, 8)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a waiting connection per rank thread
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("NXD_CKPT_LOG_LEVEL", "WARNING")
    os.environ["NXD_CKPT_XSER_INLINE_BYTES"] = str(inline_bytes(args.elems))
    # Each rank writes its tiny files on its own thread: a real rank's I/O pool overlaps large files, which these
    # are not, and 4 pool threads per rank would put 4 x N threads of one process on the GIL at once.
    os.environ.setdefault("NXD_CKPT_IO_THREADS", "1")
    # Thousands of rank threads share one GIL: each thread waiting for it wakes at every switch interval, so at
    # CPython's 5 ms a wave of 1,024 writing ranks spent its cores handing the GIL around. Threads still hand it
    # over at every blocking call (every store wait, file write), so the ranks' order of work is unchanged.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    root = tempfile.mkdtemp(prefix="nxd_bench_scale_", dir=args.dir)
    rows: list[dict[str, Any]] = []
    load1, load5, _ = os.getloadavg()
    print(f"load average before: {load1:.2f} {load5:.2f}; {os.cpu_count()} CPUs; layers={args.layers}")
    print_header()
    try:
        for n in args.ranks:
            start = time.perf_counter()
            release = store_release_s(n)
            print(f"  {n} ranks: the store releases {n} waiters in {release * 1e3:.1f} ms", file=sys.stderr)
            rows += run_world(n, args.layers, args.elems, args.ops, root, args.num_workers, release)
            print(f"  {n} ranks done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        processes = [run_processes(n, args.layers, args.elems, root) for n in args.processes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sys.setswitchinterval(switch_interval)
    load1, load5, _ = os.getloadavg()
    print_requests(rows)
    for p in processes:
        print(
            f"\n{p['ranks']} gloo processes: store operations per rank {p['store_ops_mean']:.1f} mean, "
            f"{p['store_ops_max']} max ({p['store_wait_ops_max']} waits), save {p['save_s_max']:.2f} s"
        )
    print(f"\nload average after: {load1:.2f} {load5:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "processes": processes, "layers": args.layers, "loadavg": os.getloadavg()}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
