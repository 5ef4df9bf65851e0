"""Which state files each rank writes: NxD's replication patterns as a pure function of the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import layout
from .topology import Topology


@dataclass(frozen=True)
class StateWrite:
    """One state file a rank writes. ``replicas`` are the global ranks holding the same state (DP replicas of a
    replicated state, or just the writer), so an encoding may spread the work across them."""

    kind: str
    path: str
    state: Any
    replicas: tuple[int, ...]


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
) -> list[StateWrite]:
    """The files this rank writes: model and replicated optimizer by the first of each (TP, PP[, EP])
    coordinate's replicas (DP and CP ranks; expert-DP ranks with EP), ZeRO-1 optimizer shards by every rank,
    scheduler and user content by the master (global rank 0).

    With ``spread_replicated`` (xser, where a file is many tensor files) every DP replica gets the replicated
    files too, and the encoding writes only its share of them (see ``statefile.write_state_file``).
    """
    writes: list[StateWrite] = []
    replicas = tuple(topo.replica_ranks())
    writes_replicated = topo.replica_rank == 0 or spread_replicated
    ep = topo.file_ep_rank
    if model is not None and writes_replicated:
        writes.append(StateWrite("model", layout.model_file(tag, topo.tp_rank, topo.pp_rank, ep), model, replicas))
    if optimizer is not None:
        if zero1:
            path = layout.optim_file(tag, topo.zero1_rank, topo.tp_rank, topo.pp_rank)
            writes.append(StateWrite("optimizer", path, optimizer, (topo.rank,)))
        elif writes_replicated:
            path = layout.optim_file(tag, 0, topo.tp_rank, topo.pp_rank, ep)
            writes.append(StateWrite("optimizer", path, optimizer, replicas))
    if topo.is_master:
        if scheduler is not None:
            writes.append(StateWrite("scheduler", layout.tag_path(tag, layout.SCHEDULER_FILE), scheduler, (0,)))
        if user_content is not None:
            path = layout.tag_path(tag, layout.USER_CONTENT_FILE)
            writes.append(StateWrite("user_content", path, user_content, (0,)))
    return writes
