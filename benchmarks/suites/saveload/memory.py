"""Host memory per save and load path, and the first async save: ``nxd_memory`` (peak extra host memory of a
sync save, an async save, an async save under a budget of a quarter of the state and a verified load into fresh
dicts, each as a multiple of the rank's state; a fresh manager's first async save against the next two) and
``process_first_async`` (the process's first async save, after ``prepare_async_save``, before any section)."""

from __future__ import annotations

import statistics
from typing import Any

import torch.distributed as dist

from benchmarks.core.memory import PeakRSS
from benchmarks.core.ranks import gather, slowest
from benchmarks.core.state import nbytes_of
from benchmarks.measure.first_save import first_vs_steady, prepare_beside_training, probe
from benchmarks.suites.saveload.bench import Bench, Timing, section


def _multiple(b: Bench, peak: PeakRSS, saved: int | None = None) -> float:
    """Largest rank's peak extra heap as a multiple of its own state: ``saved`` (the bytes it wrote: the save
    paths) or what it loads."""
    return max(gather(peak.extra / (saved or nbytes_of([b.model, b.optimizer]))))


def _kw(b: Bench) -> dict[str, Any]:
    """The save's arguments of this section."""
    return {"model": b.model, "optimizer": b.optimizer, "use_xser": True, "zero1_optimizer": True}


def fresh_manager_saves(b: Bench, path: str) -> dict[str, float]:
    """A fresh manager's first three async saves (its first allocates staging buffers, starts the writer)."""
    import nxd_ckpt as nxd

    manager, blocked = nxd.CheckpointManager(), []
    for i in range(3):
        dist.barrier()
        report = manager.save(path, f"async_{i}", async_save=True, **_kw(b))
        report.wait()
        blocked.append(slowest(report.blocked_s))
    manager.finalize()
    return {"first_async_blocked_s": blocked[0], "steady_async_blocked_s": statistics.median(blocked[1:])}


def first_async_peak(b: Bench, path: str, tag: str, budget: int | None = None) -> tuple[Any, PeakRSS]:
    """A fresh manager's first async save under ``PeakRSS``, untimed (its 2 ms sampler and gc.collect would sit
    inside a timed save's blocked time)."""
    import nxd_ckpt as nxd

    fresh = nxd.CheckpointManager(host_memory_budget=budget)
    peak = PeakRSS()
    dist.barrier()
    with peak:
        report = fresh.save(path, tag, async_save=True, **_kw(b))
        report.wait()
    fresh.finalize()
    return report, peak


def async_memory(b: Bench, path: str) -> dict[str, float]:
    """Peak extra memory of an async save, and of one under a budget of a quarter of what the rank writes."""
    report, peak = first_async_peak(b, path, "async_peak")
    extra = {"mem_async": _multiple(b, peak, saved=report.bytes_written)}
    budget = report.bytes_written // 4
    report, peak = first_async_peak(b, path, "async_budget", budget)
    extra["mem_async_budget"] = _multiple(b, peak, saved=report.bytes_written)
    extra["mem_async_budget_over_bytes"] = max(gather(peak.extra - budget))  # the largest rank's peak over it
    extra["budget_wait_s"] = slowest(report.budget_wait_s)
    return extra


@section("nxd_memory", "nxd_ckpt xser: sync save (timed) and verified load; peak host memory of each path")
def nxd_memory(b: Bench) -> Timing:
    """Peak host memory of each save/load path."""
    import nxd_ckpt as nxd

    path = b.path("nxd_memory")
    extra = fresh_manager_saves(b, path) | async_memory(b, path)
    peak, written = PeakRSS(), []

    def save() -> None:
        with peak:
            written.append(nxd.save_checkpoint(path, "sync", **_kw(b)).bytes_written)

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


def process_first_async(b: Bench) -> dict[str, float]:
    """The first async save of this process, as a training script makes it: ``prepare_async_save`` once the model
    and optimizer exist, training steps while its buffers are faulted in beside them, then the save; and the
    median of the next two saves. Blocked time of the slowest rank; nothing else ran in this process before."""
    import nxd_ckpt as nxd

    path = b.path("nxd_first_async")
    save = nxd.save_checkpoint  # imported before timing, as a training script imports it at its start
    dist.barrier()
    prepared = prepare_beside_training(b.model, b.optimizer)
    blocked = []
    for i in range(3):
        dist.barrier()
        report, figures = probe(lambda i=i: save(path, f"async_{i}", async_save=True, **_kw(b)))
        blocked.append(slowest(figures["blocked_s"]))
        report.wait()
    nxd.finalize_checkpoint()
    b.clean("nxd_first_async")
    ratio = first_vs_steady(blocked)
    figures = {"process_first_async_s": ratio["first_s"], "process_steady_async_s": ratio["steady_s"]}
    figures |= {k: slowest(v) for k, v in prepared.items() if k != "steps_during_prepare"}
    figures["steps_during_prepare"] = min(gather(prepared["steps_during_prepare"]))
    return figures
