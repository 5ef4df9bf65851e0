"""Never sharded state saved as replicated: a plain optimizer is the same on every model replica, or the save stops.

A save that is told (or recognises) a plain optimizer writes it once per (TP, PP[, EP]) position, from the first of
that position's replicas (its DP and CP ranks), and every replica reads that one file back. If the state in fact
differs across those ranks (a ZeRO-1 optimizer behind a wrapper nothing recognised, say), every other rank's part
would be lost without a word. So each rank sends a short fingerprint of its optimizer state in the save's first
world-wide step, and rank 0 compares the fingerprints of every replica group before anything is written
(``check_replicas``, run inside ``SavePipeline.mark_tag``'s agreement: no extra round).

The fingerprint is cheap, not exhaustive, and costs the device nothing (no graph, no transfer: a save of device state
compiles nothing it did not compile before): every tensor's name, dtype and shape; ``SAMPLES_PER_TENSOR`` values of
each host tensor, taken at evenly spaced positions (shards of one parameter's state differ there in practice;
identical replicas always agree); and, for a state dict in ZeRO-1's own layout (``base_state``, ``shape_info``:
``optimizers.is_zero1_optimizer``), the rank, since such a state is this rank's shard by construction. A plain
optimizer whose device-resident state diverged across replicas without ZeRO-1's layout is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import optimizers
from nxd_ckpt.errors import StateMismatchError
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.tree import iter_tensors

SAMPLES_PER_TENSOR = 8


@dataclass(frozen=True)
class OptimizerFingerprint:
    """One rank's optimizer as ``check_replicas`` compares it: a digest of its state, and how the user passed it."""

    digest: str
    described: str
    """The optimizer and its wrappers, outermost first (``optimizers.describe_chain``)."""


def state_fingerprint(state: Any, rank: int) -> str:
    """A short digest of an optimizer's state dict on ``rank``: its tensors' names, dtypes and shapes, a few
    sampled values of its host tensors, and the rank where the state is in ZeRO-1's layout (a shard)."""
    described: list[str] = []
    samples: list[torch.Tensor] = []
    for name, tensor in sorted(iter_tensors(state), key=lambda item: item[0]):
        described.append(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}")
        if tensor.numel() == 0 or tensor.device.type != "cpu":
            continue
        flat = tensor.detach().reshape(-1)
        positions = torch.linspace(0, flat.numel() - 1, min(SAMPLES_PER_TENSOR, flat.numel())).round().long()
        samples.append(flat.index_select(0, positions).to(torch.float64))
    if optimizers.is_zero1_optimizer(state):
        described.append(f"a ZeRO-1 shard of rank {rank}")
    values = torch.cat(samples) if samples else torch.empty(0, dtype=torch.float64)
    header = "\n".join(described).encode()
    return f"{hash_bytes(header)[1]}-{hash_bytes(values.numpy().tobytes())[1]}"


def check_replicas(fingerprints: Sequence[OptimizerFingerprint | None], groups: Sequence[Sequence[int]]) -> None:
    """Rank 0, before anything is written: StateMismatchError when two ranks of one replica group (``groups``:
    ``Topology.replica_groups``) hold different optimizer state while the save writes it as replicated (ranks that
    save sharded state, or no optimizer, send None)."""
    for group in groups:
        first = next((r for r in group if fingerprints[r] is not None), None)
        if first is None:
            continue
        base = fingerprints[first]
        assert base is not None
        other = next((r for r in group if fingerprints[r] is not None and fingerprints[r] != base), None)
        if other is None:
            continue
        raise StateMismatchError(
            f"the optimizer's state differs between ranks {first} and {other}, which hold the same model part (DP/CP "
            f"replicas), but the save writes it as replicated: one file from rank {first}, read back by every "
            f"replica, so rank {other}'s state would be lost at the resume. The optimizer passed is "
            f"{base.described}, which is not recognised as ZeRO-1. If it shards its state over DP (ZeRO-1), pass "
            "zero1_optimizer=True (or nxd_ckpt.register_zero1_optimizer(its class), or the optimizer inside the "
            "wrapper); if it should be replicated, the replicas have diverged (gradients not averaged over DP?). "
            "Nothing was written."
        )
