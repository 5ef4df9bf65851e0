"""Never sharded state saved as replicated: a plain optimizer is the same on every model replica, or the save stops.

A save that is told (or recognises) a plain optimizer writes it once per (TP, PP[, EP]) position, from the first of
that position's replicas (its DP and CP ranks), and every replica reads that one file back. If the state in fact
differs across those ranks (a ZeRO-1 optimizer behind a wrapper nothing recognised, say), every other rank's part
would be lost without a word. So each rank sends a short fingerprint of its optimizer state in the save's first
world-wide step, and rank 0 compares the fingerprints of every replica group before anything is written
(``check_replicas``, run inside ``SavePipeline.mark_tag``'s agreement: no extra round).

The fingerprint is cheap, not exhaustive: every tensor's name, dtype and shape, and ``SAMPLES_PER_TENSOR`` values
taken at evenly spaced positions (gathered into one host copy, so device state costs one small transfer). Shards of
one parameter's state differ in those values in practice; identical replicas always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


def state_fingerprint(state: Any) -> str:
    """A short digest of an optimizer's state dict: its tensors' names, dtypes, shapes and a few sampled values."""
    described: list[str] = []
    samples: list[torch.Tensor] = []
    for name, tensor in sorted(iter_tensors(state), key=lambda item: item[0]):
        described.append(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}")
        if tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        flat = tensor.detach().reshape(-1)
        count = min(SAMPLES_PER_TENSOR, flat.numel())
        positions = torch.linspace(0, flat.numel() - 1, count, device=flat.device).round().long()
        samples.append(flat.index_select(0, positions).to(torch.float64))
    values = torch.cat(samples).cpu() if samples else torch.empty(0, dtype=torch.float64)
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
