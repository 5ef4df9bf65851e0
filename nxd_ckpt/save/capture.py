"""What a save reads from the live objects, first thing, as it is at the call: the model's state dict (built once
per save, ``model_state``), the per-rank state, and what the save's first world-wide step needs of them: this
rank's share of the sharding record, whether the optimizer is ZeRO-1 (else a fingerprint of its state, which must be
the same on every model replica: ``replicated``), and its proposal of a device snapshot budget (``capture``)."""

from __future__ import annotations

from typing import Any

from nxd_ckpt import adapters, optimizers
from nxd_ckpt import resume_state as rank_states
from nxd_ckpt.device import kept_budget
from nxd_ckpt.format import sharding_marks
from nxd_ckpt.options import SaveOptions
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import replicated
from nxd_ckpt.save.context import Captured


def model_state(options: SaveOptions) -> Any:
    """The model's state dict, the one a save writes (None without a model); a model without data (meta
    tensors) fails here. The manager calls it before any collective or file, so that the refusal is on every
    rank and the state dict is built once per save."""
    if options.model is None:
        return None
    state = adapters.model_state(options.model)
    adapters.refuse_meta_for_save(state, "model")
    return state


def capture(
    coord: Coordinator,
    topo: Topology,
    options: SaveOptions,
    model_sd: Any,
    device_budget: kept_budget.KeptSnapshotBudget,
) -> Captured:
    """The state read from the live objects: the per-rank state (a collective, a gather in "gather" mode;
    copied for async saves), with the model's state dict ``model_sd`` (``model_state``), this rank's share of
    the sharding record and its proposal of a device snapshot budget (``budget_proposal``)."""
    rank_files = rank_states.stage_for_save(
        coord, topo, options.tag, options.rank_state, save_rng=options.save_rng, mode=options.rank_state_mode,
        copy_state=options.async_save,
    )  # fmt: skip
    share = None
    if options.model is not None:
        share = sharding_marks.share_for_save(
            options.model, model_sd, options.optimizer, rank=coord.rank, tp_rank=topo.tp_rank,
            replica_rank=topo.replica_rank, tp=topo.tp_size, pp_stage=topo.pp_rank,
        )  # fmt: skip
    zero1 = bool(options.zero1_optimizer) or optimizers.is_zero1_optimizer(options.optimizer)
    proposal = budget_proposal(options, model_sd, device_budget)
    fingerprint = None
    if options.optimizer is not None and not zero1 and len(topo.replica_ranks()) > 1:
        fingerprint = replicated.OptimizerFingerprint(
            replicated.state_fingerprint(adapters.optimizer_state(options.optimizer), coord.rank),
            optimizers.describe_chain(options.optimizer),
        )
    return Captured(model_sd, rank_files, share, zero1, proposal, fingerprint)


def budget_proposal(options: SaveOptions, model_sd: Any, device_budget: kept_budget.KeptSnapshotBudget) -> int | None:
    """An async save's proposal of a device snapshot budget for the model's and optimizer's device state (the
    kept one: ``kept_budget``); None without device state, or for a sync save. Never raises (it runs before
    the collective the others wait in): a state it cannot size fails the save in ``stage``, on every rank."""
    if not options.async_save:
        return None
    try:
        optimizer = adapters.optimizer_state(options.optimizer) if options.optimizer is not None else None
        state = kept_budget.device_tensors(t for t in (model_sd, optimizer) if t is not None)
        return device_budget.proposal(options.device_budget, state) if state else None
    except Exception:
        return None


def scheduler_state(options: SaveOptions) -> Any:
    """The scheduler's state a save writes, or None."""
    return adapters.scheduler_state(options.scheduler) if options.scheduler is not None else None
