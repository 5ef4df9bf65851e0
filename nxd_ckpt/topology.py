"""The parallel layout: NxD's row-major ``[PP, DP, TP]`` rank grid, as pure arithmetic (no torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Sizes of the parallel dimensions plus this process's global rank.

    Global rank = pp * (DP * TP) + dp * TP + tp, as in NeuronX Distributed.
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "local_world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.dp_size)

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank."""
        return (
            rank // (self.tp_size * self.dp_size),
            (rank // self.tp_size) % self.dp_size,
            rank % self.tp_size,
        )

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """Global rank at grid coordinates (pp, dp, tp)."""
        return pp * self.dp_size * self.tp_size + dp * self.tp_size + tp

    def dp_group_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks that hold the same (TP, PP) coordinate as ``rank`` (its DP replicas), in DP order."""
        pp, _, tp = self.coords_of(self.rank if rank is None else rank)
        return [self.rank_of(pp, d, tp) for d in range(self.dp_size)]

    def describe(self) -> str:
        return f"TP={self.tp_size} PP={self.pp_size} DP={self.dp_size} (world {self.world_size})"
