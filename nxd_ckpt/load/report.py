"""RestoreReport: where a load through the memory tier found its checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

TIER_ORDER = ("memory", "peer", "durable")
"""The tiers a rank's state can come from, nearest first."""


@dataclass(frozen=True)
class RestoreReport:
    """Where a load through the memory tier found its checkpoint: the tag, and each rank's tier."""

    tag: str
    tiers: list[str]
    """By rank: ``memory`` (this node's memory directory), ``peer`` (files fetched from another node), or
    ``durable`` (the checkpoint directory)."""

    @property
    def tier(self) -> str:
        """The tier of this load as a whole: the furthest any rank had to go."""
        return max(self.tiers, key=TIER_ORDER.index) if self.tiers else "durable"

    def summary(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, tier in enumerate(self.tiers):
            groups.setdefault(tier, []).append(rank)
        return ", ".join(f"{tier}: ranks {_ranges(ranks)}" for tier, ranks in groups.items())


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)
