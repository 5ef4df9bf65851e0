"""The stage step of a save: every copy it makes, by one of three strategies (the pipeline picks one by the options).

  pooled     async: a training-safe copy of the state files in reused host buffers (``staging.StagingPool``);
             device tensors: a copy on the device (``device.snapshot``) that a transfer thread brings to the host
             ahead of the writers;
  budgeted   async under a host memory budget (``budget.BudgetedStager``): the device copies that fit the device
             budget are cut first; the write is handed over, then the call copies what fits the host budget
             while the writer writes (``run_budgeted``), waiting for the files that read live tensors;
  live       sync: the live tensors are the sources; device tensors reach the host on a thread running ahead of
             the writers (one sync for all).

A snapshot that ran out of device memory is reported and shrinks the kept device budget (``after_fallback``).
"""

from __future__ import annotations

import logging

from nxd_ckpt import knobs
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import distinct_storages, native_device, on_device
from nxd_ckpt.device.kept_budget import KeptSnapshotBudget
from nxd_ckpt.device.transfer import DeviceTransfer, run_on_transfer_thread
from nxd_ckpt.ranks.deadlines import Deadline
from nxd_ckpt.save import budget, plan
from nxd_ckpt.save.context import SaveContext, SaveServices, Staged
from nxd_ckpt.save.report import SaveReport

logger = logging.getLogger("nxd_ckpt")


def pooled(services: SaveServices, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport) -> Staged:
    """Async: a training-safe copy of the state files in reused host buffers (device tensors: a copy on the
    device, brought to the host by a transfer thread), handed back once the files are written. The per-rank
    state files are copies already (``capture``)."""
    pool, files, rank = services.staging_pool, planned.state_files, ctx.coordinator.rank
    needed = [id(t) for t in plan.tensors_to_write(files, rank)]  # in the writers' order
    lease = pool.stage(
        [w.state for w in files], ctx.options.timeout_s, needed=needed, device_budget=ctx.options.device_budget,
        rank=rank,
    )  # fmt: skip
    report.staging_allocated_bytes = lease.allocated_bytes
    if lease.snapshot is not None:
        report.device_snapshot_bytes = lease.snapshot.snapshot_bytes
        report.device_direct_bytes = lease.snapshot.direct_bytes
        report.device_direct_s = lease.snapshot.direct_s
        report.device_budget_bytes = lease.snapshot.budget_bytes
        after_fallback(services.device_budget, report, lease.snapshot.fallback, lease.snapshot.snapshot_bytes, rank)
    copies = [w.with_state(state) for w, state in zip(files, lease.trees, strict=True)]
    return Staged([*copies, *planned.rank_state_files], lease=lease, pool=pool, fetcher=lease.transfer)


def budgeted(
    services: SaveServices, ctx: SaveContext, planned: plan.SavePlan, report: SaveReport
) -> tuple[Staged, bool]:
    """Async under a host memory budget, before the hand-off: the device copies that fit the device budget are
    cut, and the stager that will copy what fits the host budget is made (every written file frees the copies
    it was written from). Returns what the writer writes, and whether device copies wait to be brought to the
    host (``run_budgeted``)."""
    options, rank = ctx.options, ctx.coordinator.rank
    with ctx.arrive_on_failure():
        tensors = plan.tensors_to_write(planned.state_files, rank)
        device = list({id(t): t for t in tensors if on_device(t)}.values())
        copies = None
        if device:
            native = native_device(device)
            pool = services.staging_pool
            arena = pool.pinned_arena(options.budget_bytes, native.staging_empty) if native is not None else None
            copies = device_snapshot.copy_on_device(device, options.device_budget, arena)
        stager = budget.BudgetedStager(
            tensors, options.budget_bytes, options.timeout_s,
            frozen=copies.sources if copies is not None else None,
            fetch=copies.fetch if copies is not None else None,
            batch_bytes=knobs.xla_transfer_batch_bytes(),
            give_back=copies.give_back if copies is not None else None,
            room=copies.room if copies is not None else None,
            rank=rank,
        )  # fmt: skip
        stager.watch(ctx.storage)  # a written file frees the copies it was written from
        if ctx.tier is not None:
            stager.watch(ctx.tier.storage)
    frozen = copies is not None and copies.snapshot_bytes > 0
    if copies is not None:
        copies.sources.clear()  # the stager holds the device copies now, and drops each once it is on the host
        report.device_snapshot_bytes = copies.snapshot_bytes
        report.device_direct_bytes = copies.direct_bytes
        report.device_budget_bytes = copies.budget_bytes
        after_fallback(services.device_budget, report, copies.fallback, copies.snapshot_bytes, rank)
    if frozen:
        stager.begin_frozen()  # writers wait for the copies run_budgeted brings
    return Staged(planned.writes, fetcher=stager, pool=services.staging_pool), frozen


def run_budgeted(staged: Staged, frozen: bool, report: SaveReport) -> None:
    """After the hand-off: the device copies travel to the host beside training (``frozen``), within the budget;
    the call copies what fits and waits for the rest."""
    stager = staged.fetcher
    assert isinstance(stager, budget.BudgetedStager)
    if frozen:
        run_on_transfer_thread(stager.stage_frozen)
    stager.stage()
    report.budget_wait_s = stager.waited_s


def live(ctx: SaveContext, planned: plan.SavePlan) -> Staged:
    """Sync: training is blocked in the call, so the live tensors are the sources; device tensors are copied
    to the host by a thread running ahead of the writers (one sync for all)."""
    tensors = plan.tensors_to_write(planned.state_files, ctx.coordinator.rank)
    device = list({id(t): t for t in tensors if on_device(t)}.values())
    if not device:
        return Staged(planned.writes)
    first, alias_of = distinct_storages(device)  # tied weights travel once; each key still gets its own copy
    moved = [device[i] for i in first]
    aliases = {id(device[j]): device[i] for j, i in alias_of.items()}
    deadline = Deadline(ctx.options.timeout_s, ctx.coordinator.rank)
    return Staged(planned.writes, fetcher=DeviceTransfer(moved, moved, aliases=aliases, deadline=deadline))


def after_fallback(
    device_budget: KeptSnapshotBudget, report: SaveReport, fallback: str | None, cloned_bytes: int, rank: int
) -> None:
    """A snapshot that ran out of device memory (``fallback``) is reported, warned about, and the kept budget
    shrinks (``KeptSnapshotBudget.shrink``) so that the next save does not run out again."""
    if fallback is None:
        return
    smaller = device_budget.shrink(cloned_bytes)
    report.device_snapshot_fallback = f"{fallback}; the next saves propose a budget of {smaller} bytes"
    logger.warning("checkpoint %s on rank %d: %s", report.tag, rank, report.device_snapshot_fallback)


def close(staged: Staged, ctx: SaveContext, report: SaveReport) -> BaseException | None:
    """After the write: the fetcher stopped and the copies handed back (``Staged.close``), what they cost
    reported; the fetcher's unseen error, which fails this rank's write."""
    fetch_error, pinned = staged.close(ctx.monitor)
    report.staging_allocated_bytes += pinned
    if isinstance(staged.fetcher, budget.BudgetedStager):
        report.budget_peak_bytes = staged.fetcher.peak_bytes
        report.budget_copied_by_writers_bytes = staged.fetcher.copied_by_writers_bytes
        report.budget_overdrawn_bytes = staged.fetcher.overdrawn_bytes
    return fetch_error
