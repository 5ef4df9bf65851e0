"""The saveload suite's rank function: build the state, make the process's first async save, then run every
section --reps times in a rotated order; rank 0 writes the timings."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from benchmarks.core.ranks import gather, write_result
from benchmarks.core.state import nbytes_of, transformer_state
from benchmarks.core.timing import rotated
from benchmarks.suites.saveload.bench import REGISTRY, Bench, Timing
from benchmarks.suites.saveload.memory import process_first_async

GIB = 1 << 30


def repetitions(bench: Bench, names: list[str], reps: int) -> dict[str, list[Timing]]:
    """Every section ``reps`` times, the order rotated each repetition; checked in the first repetition only."""
    results: dict[str, list[Timing]] = {n: [] for n in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            timing = REGISTRY[name][1](bench)
            results[name].append(timing)
            if bench.rank == 0:
                load = f"{timing.load_s:.2f} s" if timing.load_s is not None else "-"
                print(f"[rep {rep}] {name}: save {timing.save_s:.2f} s, load {load}", flush=True)
            bench.check = False  # verified once per section is enough
        bench.check = rep == 0
    return results


def worker(options: dict[str, Any], root: str, out: str) -> None:
    """One rank of the run (``options``: size_gb, hidden, sections, reps, warm, warmup)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = transformer_state(int(options["size_gb"] * GIB), rank, world, options["hidden"])
    saved = nbytes_of(model) + sum(gather(nbytes_of(optimizer)))
    cold = os.geteuid() == 0 and not options["warm"]
    bench = Bench(rank, world, root, model, optimizer, saved, cold)
    names = [n for n in options["sections"] if REGISTRY[n][2]()]
    # The process's first async save, before anything else (it is the one-time set-up being measured).
    first_async = process_first_async(bench) if "nxd_memory" in names else None
    # Warm-up (untimed): first-touch of memory and imports would otherwise land on whichever section runs first.
    for name in names if options["warmup"] else []:
        REGISTRY[name][1](bench)
    results = repetitions(bench, names, options["reps"])
    write_result(out, {
        "bytes": saved,
        "cold": cold,
        "first_async": first_async,
        "results": {n: [[t.save_s, t.load_s] for t in ts] for n, ts in results.items()},
        "extra": {n: [t.extra for t in ts] for n, ts in results.items() if ts and ts[0].extra},
    })  # fmt: skip
    dist.barrier()
