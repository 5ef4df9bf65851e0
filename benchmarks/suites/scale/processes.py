"""The save on real gloo processes (``--processes``), to check the store figures against real torch.distributed."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.suites.scale.workload import RANKS_PER_NODE, inline_bytes, layout_for, stage_state
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.ranks.topology import Topology


def process_rank(layers: int, elems: int, directory: str, out_dir: str) -> None:
    """One rank of ``--processes``: a real gloo rank (``testing.multiprocess``) saving twice; its store operations
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
