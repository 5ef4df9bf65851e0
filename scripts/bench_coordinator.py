#!/usr/bin/env python3
"""Cost of a deadline-guarded cross-rank step next to the bare collective it wraps, on real gloo ranks.

Each ``Coordinator.master_computes`` step checks in on the c10d store (so a missing rank is named and the wait
has a deadline) before its one broadcast; this measures that step against a bare ``broadcast_object_list`` of
the same payload, and ``run_all`` against a bare ``all_gather_object``, and prints the ratios. A save issues one
or two such steps, a load four to six.

    python scripts/bench_coordinator.py --ranks 2 --steps 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the test harness, harness/


def _rank(rank: int, world: int, port: int, steps: int, out: mp.Queue) -> None:
    import torch.distributed as tdist

    from harness import rendezvous
    from nxd_ckpt.ranks.coordinator import Coordinator

    rendezvous.init_process_group(port, rank, world)
    coord = Coordinator()
    payload = {"tag": "step_1000", "created_at": time.time(), "files": [f"f{i}" for i in range(32)]}

    def timed(fn) -> float:
        fn()  # warm-up
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps

    def bare_broadcast() -> None:
        box = [payload if rank == 0 else None]
        tdist.broadcast_object_list(box, src=0)

    def bare_gather() -> None:
        box = [None] * world
        tdist.all_gather_object(box, None)

    results = {
        "bare broadcast_object_list": timed(bare_broadcast),
        "master_computes (store check-in + broadcast)": timed(lambda: coord.master_computes(lambda: payload, "bench")),
        "bare all_gather_object": timed(bare_gather),
        "run_all (store check-in + all_gather)": timed(lambda: coord.run_all(lambda: None, "bench")),
        "barrier (store only)": timed(lambda: coord.barrier("bench")),
    }
    if rank == 0:
        out.put(results)
    tdist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("NXD_CKPT_TIMEOUT_S", "120")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from harness import rendezvous

    store = rendezvous.serve_store()  # the ranks meet here (port 0 bound by this process, handed to them)
    port = int(store.port)
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.steps, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"{args.ranks} gloo ranks on 127.0.0.1, {args.steps} steps each, mean per step:")
    for name, seconds in results.items():
        print(f"  {name:<46} {seconds * 1e3:8.3f} ms")
    mc = results["master_computes (store check-in + broadcast)"] / results["bare broadcast_object_list"]
    ra = results["run_all (store check-in + all_gather)"] / results["bare all_gather_object"]
    print(f"ratio master_computes / bare broadcast: {mc:.2f}x; run_all / bare all_gather: {ra:.2f}x")


if __name__ == "__main__":
    main()
