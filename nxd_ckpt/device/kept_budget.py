"""The device snapshot budget as one decision per process and state layout: proposed by each rank, agreed as the
minimum over the ranks in the save's first collective, and kept from save to save until the state's shapes and
dtypes (or the budget asked for) change.

The set of tensors a snapshot copies on the device follows from the budget; on XLA it is the snapshot graph. A
budget measured anew at each save (free memory shifts from step to step) would make each save a new graph (on
Trainium a neuronx-cc compile inside the save call), and ranks measuring their own would clone different sets
(some ranks block, others do not). Kept and agreed, every save of a fixed model compiles nothing after the first.
Only the training thread touches it (saves, ``prepare_async_save``, a resume's preparation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.device.backend import SOURCE_PEAK, SnapshotBudget, on_device
from nxd_ckpt.tree import iter_tensors


def device_tensors(trees: Iterable[Any]) -> list[torch.Tensor]:
    """The distinct device tensors of ``trees`` (a save's model and optimizer state), in tree order."""
    found: dict[int, torch.Tensor] = {}
    for tree in trees:
        for _, t in iter_tensors(tree):
            if on_device(t):
                found.setdefault(id(t), t)
    return list(found.values())


def layout_of(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a kept budget holds for: the device, dtype and shape of each tensor, in order."""
    return tuple((t.device.type, str(t.dtype), tuple(t.shape)) for t in tensors)


@dataclass(frozen=True)
class _Decision:
    key: tuple
    """(the budget asked for, ``layout_of`` the state) it was made for."""
    bytes: int
    agreed: bool
    """Made by a save's agreement over the ranks (else: this rank's proposal, from a warm-up or a save)."""


class KeptSnapshotBudget:
    """This process's device snapshot budget for the state it saves (``CheckpointManager`` holds one)."""

    def __init__(self) -> None:
        self._decision: _Decision | None = None

    def proposal(self, asked: SnapshotBudget, state: Sequence[torch.Tensor]) -> int:
        """What this rank proposes at a save of ``state`` (its device tensors): the kept budget when one holds
        for this state and ``asked``, else ``asked.resolve`` now (kept, so it is measured once)."""
        key = (asked, layout_of(state))
        if self._decision is None or self._decision.key != key:
            self._decision = _Decision(key, asked.resolve(state)[0], agreed=False)
        return self._decision.bytes

    def agree(self, agreed: int) -> SnapshotBudget:
        """The save's agreement (the minimum of every rank's ``proposal``) becomes the kept budget; returns it."""
        assert self._decision is not None, "agree follows proposal"
        self._decision = _Decision(self._decision.key, agreed, agreed=True)
        return SnapshotBudget(agreed)

    def for_warm_up(self, asked: SnapshotBudget, state: Sequence[torch.Tensor]) -> SnapshotBudget | None:
        """The budget a warm-up (``prepare_async_save``, a resume's preparation) snapshots ``state`` within: the
        kept one, else this rank's proposal, kept for the first save to propose. None (nothing to warm) for
        ``auto`` on a device sized by its peak before a save has measured it: before the training steps ran,
        the peak says nothing of what they need."""
        key = (asked, layout_of(state))
        if self._decision is not None and self._decision.key == key:
            return SnapshotBudget(self._decision.bytes)
        limit, source = asked.resolve(state)
        if source == SOURCE_PEAK:
            return None
        self._decision = _Decision(key, limit, agreed=False)
        return SnapshotBudget(limit)

    def shrink(self, cloned_bytes: int) -> int:
        """After an out-of-memory in a snapshot that had cloned ``cloned_bytes``: half of that (half the budget when
        nothing was cloned) is kept, and proposed at the next save, so that it does not meet one again."""
        if self._decision is None:
            return 0
        smaller = (cloned_bytes or self._decision.bytes) // 2
        self._decision = _Decision(self._decision.key, min(smaller, self._decision.bytes), agreed=False)
        return self._decision.bytes


def agree(proposals: Sequence[int | None]) -> int | None:
    """The budget every rank uses: the smallest proposed (ranks without device state propose None)."""
    given = [p for p in proposals if p is not None]
    return min(given) if given else None
