"""The device snapshot budget as one decision per process and state layout: proposed by each rank, agreed as the
minimum over the ranks in the save's first collective, and kept from save to save until the state's shapes and
dtypes (or the budget asked for) change.

The set of tensors a snapshot copies on the device follows from the budget; on XLA it is the snapshot graph. A
budget measured anew at each save (free memory shifts from step to step) would make each save a new graph (on
Trainium a neuronx-cc compile inside the save call), and ranks measuring their own would clone different sets
(some ranks block, others do not). Kept and agreed, every save of a fixed model compiles nothing after the first.
Only the training thread touches it (saves, ``prepare_async_save``, a resume's preparation).

The NxD path agrees inside the save's first collective, before its snapshot. DCP's ``async_save`` stages before
any collective of the save, so the DCP front end agrees one save late, in DCP's own plan gather (no round of its
own): ``nxd_ckpt.dcp.Stager`` posts this process's ``Offer`` (``offer``), the writer's local plan carries it to
the coordinator (``take_offer``), which sends back the least of the ranks' offers, and the writer hands it to the
stager (``answer``), which keeps it from its next save on (``answer_for``). Each offer has a ticket, new whenever
this process's proposal changes (a new layout measured, a shrink), so an answer to an older proposal is not taken.
"""

from __future__ import annotations

import itertools
import threading
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


_tickets = itertools.count(1)


class KeptSnapshotBudget:
    """This process's device snapshot budget for the state it saves (``CheckpointManager`` and each
    ``nxd_ckpt.dcp.Stager`` hold one)."""

    def __init__(self) -> None:
        self._decision: _Decision | None = None
        self.ticket = 0
        """Names this rank's current proposal (new at each ``proposal`` measured anew and each ``shrink``; kept by
        ``agree``): an ``Offer``'s, so that the answer to an older proposal is told apart."""

    @property
    def bytes(self) -> int | None:
        """The budget kept now (None before any proposal)."""
        return self._decision.bytes if self._decision is not None else None

    def proposal(self, asked: SnapshotBudget, state: Sequence[torch.Tensor]) -> int:
        """What this rank proposes at a save of ``state`` (its device tensors): the kept budget when one holds
        for this state and ``asked``, else ``asked.resolve`` now (kept, so it is measured once)."""
        key = (asked, layout_of(state))
        if self._decision is None or self._decision.key != key:
            self._decision = _Decision(key, asked.resolve(state)[0], agreed=False)
            self.ticket = next(_tickets)
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
        self.ticket = next(_tickets)
        return SnapshotBudget(limit)

    def shrink(self, cloned_bytes: int) -> int:
        """After an out-of-memory in a snapshot that had cloned ``cloned_bytes``: half of that (half the budget when
        nothing was cloned) is kept, and proposed at the next save, so that it does not meet one again."""
        if self._decision is None:
            return 0
        smaller = (cloned_bytes or self._decision.bytes) // 2
        self._decision = _Decision(self._decision.key, min(smaller, self._decision.bytes), agreed=False)
        self.ticket = next(_tickets)
        return self._decision.bytes

    def take_answer(self, agreed: int | None) -> None:
        """The ranks' answer to this rank's current proposal (``answer_for``), kept when it is less than the kept
        budget, or when nothing was agreed yet (the answer is the least offer, this rank's included)."""
        if agreed is None or self._decision is None:
            return
        if agreed < self._decision.bytes or not self._decision.agreed:
            self.agree(min(agreed, self._decision.bytes))


def agree(proposals: Sequence[int | None]) -> int | None:
    """The budget every rank uses: the smallest proposed (ranks without device state propose None)."""
    given = [p for p in proposals if p is not None]
    return min(given) if given else None


@dataclass(frozen=True)
class Offer:
    """A rank's proposal as it travels in DCP's plan gather: the budget and the ticket that names it on its rank."""

    ticket: int
    bytes: int


class _Round:
    """This process's side of the DCP front end's agreement: the latest offer, taken by the next writer's local
    plan, and the answers the writers brought back, by ticket (the few latest)."""

    KEPT_ANSWERS = 16

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.offered: Offer | None = None
        self.answers: dict[int, int] = {}


_ROUND = _Round()


def offer(ticket: int, budget: int) -> None:
    """Stager, at a save of device state: this rank's proposal, for the save's plan gather to carry."""
    with _ROUND.lock:
        _ROUND.offered = Offer(ticket, budget)


def take_offer() -> Offer | None:
    """Writer, in its local plan (DCP's upload thread): the latest offer of this process, once (a later save
    without a stager's offer, a sync ``dcp.save``, carries none)."""
    with _ROUND.lock:
        taken, _ROUND.offered = _ROUND.offered, None
        return taken


def answer(ticket: int, agreed: int) -> None:
    """Writer, once the coordinator's plan reached it: the ranks' least offer, answering this rank's ``ticket``."""
    with _ROUND.lock:
        _ROUND.answers[ticket] = agreed
        while len(_ROUND.answers) > _Round.KEPT_ANSWERS:
            del _ROUND.answers[next(iter(_ROUND.answers))]


def answer_for(ticket: int) -> int | None:
    """Stager, at its next save: the agreed budget answering ``ticket``, if a save's plan gather brought one."""
    with _ROUND.lock:
        return _ROUND.answers.get(ticket)
