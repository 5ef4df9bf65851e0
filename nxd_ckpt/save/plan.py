"""Which state files each rank writes, and which tensors each write needs: decided once, as pure functions over
frozen plan items (NxD's replication patterns as a function of the layout).

``plan_save`` says which state files this rank writes (model and replicated optimizer by DP rank 0 of each (TP, PP)
coordinate, or spread over the DP replicas for xser; ZeRO-1 shards by every rank; scheduler and user content by
the master); ``tensors_to_write`` which tensors this rank's writers will read (so staging copies only those), as
the writer itself decides it (``statefile.tensors_to_write``; which tensor files of a replicated xser state file
a replica writes: ``xser.replica_share``), so the two cannot disagree. ``SavePlan`` is the one value listing
every file a rank writes in a save: those state files, then its per-rank state files (``rank_state_writes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from nxd_ckpt import adapters, statefile, tree
from nxd_ckpt.format import layout
from nxd_ckpt.ranks.topology import Topology

STATE_KINDS = ("model", "optimizer")
"""Kinds whose files are state files (plain or xser, possibly spread over replicas); the rest are plain."""


@dataclass(frozen=True)
class StateWrite:
    """One state file a rank writes. ``replicas`` are the global ranks holding the same state (DP replicas of a
    replicated state, or just the writer), so an encoding may spread the work across them."""

    kind: str
    path: str
    state: Any
    replicas: tuple[int, ...]
    xser: bool = False
    """Written in the xser encoding (model and optimizer of an xser save); else one ``torch.save`` file."""

    @property
    def is_state_file(self) -> bool:
        return self.kind in STATE_KINDS

    def with_state(self, state: Any) -> StateWrite:
        """The same write of another copy of the state (e.g. the staged host copy)."""
        return replace(self, state=state)


@dataclass(frozen=True)
class SavePlan:
    """Every file one rank writes in a save, in the order it writes them: its state files (``plan_save``), then
    its per-rank state files (``rank_state_writes``), which staging leaves alone (they are captured as copies)."""

    state_files: tuple[StateWrite, ...]
    rank_state_files: tuple[StateWrite, ...] = ()

    @property
    def writes(self) -> list[StateWrite]:
        """All of them, state files first."""
        return [*self.state_files, *self.rank_state_files]


def rank_state_writes(files: Sequence[tuple[str, Any]], rank: int) -> tuple[StateWrite, ...]:
    """This rank's per-rank state files (``rank_state.stage_for_save``'s (path, host state) pairs) as plain
    writes of this rank alone."""
    return tuple(StateWrite("rank_state", path, state, (rank,)) for path, state in files)


def plan_save(
    topo: Topology,
    tag: str,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    zero1: bool = False,
    spread_replicated: bool = False,
    use_xser: bool | None = None,
) -> list[StateWrite]:
    """The files this rank writes: model and replicated optimizer by the first of each (TP, PP[, EP])
    coordinate's replicas (DP and CP ranks; expert-DP ranks with EP), ZeRO-1 optimizer shards by every rank,
    scheduler and user content by the master (global rank 0).

    With ``use_xser`` (default: ``spread_replicated``) model and optimizer files are xser, and every DP replica
    gets the replicated files too: each writes only its share of the tensor files (``xser.replica_share``).
    """
    xser_files = spread_replicated if use_xser is None else use_xser
    spread = spread_replicated or xser_files
    writes: list[StateWrite] = []
    replicas = tuple(topo.replica_ranks())
    writes_replicated = topo.replica_rank == 0 or spread
    ep = topo.file_ep_rank
    if model is not None and writes_replicated:
        path = layout.model_file(tag, topo.tp_rank, topo.pp_rank, ep)
        writes.append(StateWrite("model", path, model, replicas, xser_files))
    if optimizer is not None:
        if zero1:
            path = layout.optim_file(tag, topo.zero1_rank, topo.tp_rank, topo.pp_rank)
            writes.append(StateWrite("optimizer", path, optimizer, (topo.rank,), xser_files))
        elif writes_replicated:
            path = layout.optim_file(tag, 0, topo.tp_rank, topo.pp_rank, ep)
            writes.append(StateWrite("optimizer", path, optimizer, replicas, xser_files))
    if topo.is_master:
        if scheduler is not None:
            writes.append(StateWrite("scheduler", layout.tag_path(tag, layout.SCHEDULER_FILE), scheduler, (0,)))
        if user_content is not None:
            path = layout.tag_path(tag, layout.USER_CONTENT_FILE)
            writes.append(StateWrite("user_content", path, user_content, (0,)))
    return writes


def tensors_of_write(write: StateWrite, rank: int) -> list[torch.Tensor]:
    """The tensors the writer of ``write`` reads on ``rank``, in about the order it reads them
    (``statefile.tensors_to_write``: all of them for a plain file; for xser, the inlined ones and this rank's
    share of the tensor files)."""
    return statefile.tensors_to_write(write.state, xser_encoding=write.xser, replicas=write.replicas, rank=rank)


def tensors_to_write(writes: Sequence[StateWrite], rank: int) -> list[torch.Tensor]:
    """The tensors this rank's writers will read for all of ``writes``, in order (staging copies only these)."""
    return [t for w in writes for t in tensors_of_write(w, rank)]


def optimizer_tree(optimizer: Any) -> Any:
    """The optimizer's state as a save plans it (NxD's containers), or None."""
    return tree.nxd_containers(adapters.optimizer_state(optimizer)) if optimizer is not None else None


def planned_tensors(
    topo: Topology, model_state: Any, optimizer: Any, *, use_xser: bool, zero1: bool
) -> list[torch.Tensor]:
    """The tensors an async save of the model's state dict ``model_state`` and ``optimizer`` with these options
    stages on this rank (its share of
    xser files among DP replicas, nothing of a plain file another replica writes), by the save's own plan (what
    ``prepare_async_save`` prepares for)."""
    writes = plan_save(
        topo,
        "planned",
        model=model_state,
        optimizer=optimizer_tree(optimizer),
        zero1=zero1,
        use_xser=use_xser,
    )
    return tensors_to_write(writes, topo.rank)
