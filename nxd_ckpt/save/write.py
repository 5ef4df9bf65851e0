"""The write step of a save: this rank's files, durable, with its manifest, into the checkpoint directory or
through the memory tier (``TierSave.write``: node memory, its peers, and every ``durable_every``-th time the
checkpoint directory), on a helper thread watched for stalls (``write_rank``). No collectives: an async save runs
it on the writer thread."""

from __future__ import annotations

from nxd_ckpt import statefile, tree
from nxd_ckpt.save.context import SaveContext, Staged
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.storage import Storage
from nxd_ckpt.watchdog import StorageMonitor, run_watched


def write_rank(ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
    """This rank's files, on a helper thread watched for stalls and overdue files: a storage call that never
    returns raises here (naming the file and the bytes moved) instead of hanging this rank."""
    rank = ctx.coordinator.rank
    ctx.monitor.reset(f"writing {ctx.tag!r} on rank {rank}")
    if ctx.tier is not None:
        run_watched(lambda: write_tiers(ctx, staged, report), ctx.monitor)
    else:
        run_watched(lambda: write_durable(ctx, staged, report), ctx.monitor)


def write_durable(ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
    """The checkpoint directory: every file fsynced in one batch at the end, then the rank's manifest."""
    storage = ctx.storage
    with storage.durability_batch():
        written = write_files(storage, staged, ctx.coordinator.rank, report, ctx.monitor)
    storage.sync_dirs({p.rsplit("/", 1)[0] for p in written})
    storage.write_manifest()  # before arriving: 'done' implies every rank's manifest exists
    report.files_written = len(written)


def write_tiers(ctx: SaveContext, staged: Staged, report: SaveReport) -> None:
    """Through the memory tier, in one call of it: node memory first (the copy every other tier is made from),
    then the peers, then, for a durable save, the checkpoint directory."""
    assert ctx.tier is not None
    rank = ctx.coordinator.rank
    written = ctx.tier.write(
        lambda share: write_files(share, staged, rank, report, ctx.monitor),
        ctx.commit.metadata if rank == 0 else None,
        ctx.storage if ctx.commit.durable else None,
        on_sealed=staged.lease.release if staged.lease is not None else None,
    )
    report.files_written = len(written)


def write_files(
    target: Storage, staged: Staged, rank: int, report: SaveReport, monitor: StorageMonitor | None = None
) -> list[str]:
    """Every staged write into ``target``; the paths written (tensor bytes are added to the report). ``monitor``
    watches the storage calls (not the waits for device copies)."""
    written: list[str] = []
    host = staged.host(monitor)
    for w in staged.writes:
        if w.is_state_file:
            done = statefile.write_state_file(
                target, w.path, w.state, xser_encoding=w.xser, replicas=w.replicas, rank=rank, host=host
            )
            written += done.paths
            report.bytes_written += done.nbytes
        else:
            written += statefile.write_plain(target, w.path, w.state, host=host)
            report.bytes_written += tree.tensor_bytes(w.state)
    return written
