"""The parallel layout as a rank table: every global rank's coordinates and every group's members.

Coordinates are never recomputed from sizes: a ``Topology`` holds the group member lists of the parallel state
in force (NxD's ``parallel_state`` replica groups, or the groups ``nxd_ckpt.initialize_model_parallel``
built), and a rank's TP/PP/DP/CP/EP/expert-DP rank is its position in its group, as NxD's getters report it.
``build_nxd_groups`` is the pure arithmetic of NxD's ``initialize_model_parallel`` (release 2.29): the row-major
``[PP, DP, CP, TP]`` / ``[PP, EDP, EP, TP]`` grids, trn1's non-contiguous TP=4 groups and trn2's
ascending-descending ring for large worlds. No torch.distributed here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from nxd_ckpt.errors import CheckpointError

GroupList = tuple[tuple[int, ...], ...]
Platform = Literal["trn1", "trn2", "trn3", "generic"]
PLATFORM_ENV = "NXD_CKPT_PLATFORM"
"""Overrides the Neuron platform nxd_ckpt's own ``initialize_model_parallel`` builds groups for."""

_KINDS = ("tp", "pp", "dp", "cp", "ep", "edp")
_LIST_INDEXED = ("pp", "dp")
"""Kinds whose rank is the position in the member list as NxD stores it (NxD's DP/PP getters search the list
under trn2's ring layout); the others are ranks of torch process groups, which number members in sorted order.
In every other NxD layout the lists are sorted, so both rules agree."""


class LayoutError(CheckpointError, ValueError):
    """The parallel groups in force are inconsistent (a rank missing or seen twice, sizes that disagree)."""


@dataclass(frozen=True)
class RankGroups:
    """Member lists of every parallel group over the whole world, as NxD's ``*_replica_groups()`` return them."""

    tp: GroupList
    pp: GroupList
    dp: GroupList
    cp: GroupList
    ep: GroupList
    edp: GroupList

    def of(self, kind: str) -> GroupList:
        return getattr(self, kind)  # type: ignore[no-any-return]


def _freeze(groups: object) -> GroupList:
    return tuple(tuple(int(r) for r in g) for g in groups)  # type: ignore[attr-defined]


def detect_platform(platform: str | None = None) -> str:
    """The Neuron platform: ``platform`` if given, else NXD_CKPT_PLATFORM, else torch_neuronx's answer, else
    "generic" (no Neuron SDK: NxD's plain row-major layout)."""
    from nxd_ckpt import knobs

    value = platform or knobs.platform()
    if not value:
        try:
            from torch_neuronx.utils import get_platform_target  # type: ignore[import-not-found]

            value = str(get_platform_target())
        except Exception:
            value = "generic"
    value = value.strip().lower()
    if value.startswith("trn1"):  # trn1n is a trn1 for NxD
        return "trn1"
    if value.startswith("trn2"):
        return "trn2"
    if value.startswith("trn3"):
        return "trn3"
    if value in ("generic", "cpu", "custom"):
        return "generic"
    raise ValueError(f"unknown Neuron platform {value!r}; use trn1, trn2, trn3 or generic ({PLATFORM_ENV})")


def build_nxd_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    *,
    platform: str = "generic",
    lnc_size: int = 1,
    local_world_size: int | None = None,
) -> RankGroups:
    """The groups NxD's ``initialize_model_parallel`` builds for these sizes on ``platform``.

    ``local_world_size`` is ranks per node (NxD reads LOCAL_WORLD_SIZE; default: the whole world for trn1's
    TP=4 layout, 64 for trn2's ring). Sizes are clipped to the world size as NxD does.
    """
    world = int(world_size)
    tp = min(int(tensor_model_parallel_size), world)
    pp = min(int(pipeline_model_parallel_size), world)
    cp = min(int(context_parallel_size), world)
    ep = min(int(expert_model_parallel_size), world)
    if min(world, tp, pp, cp, ep) < 1:
        raise ValueError(f"world and parallel sizes must be >= 1, got world={world} TP={tp} PP={pp} CP={cp} EP={ep}")
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp}")
    if world % (tp * pp * ep):
        raise ValueError(f"world size {world} is not divisible by TP*PP*EP = {tp}*{pp}*{ep}")
    dp = world // (tp * pp * cp)
    edp = world // (tp * pp * ep)
    ranks = np.arange(world)  # numpy: a process's first torch.arange costs ~17 ms, inside its first save
    if tp == 4 and platform == "trn1":
        # trn1: a TP=4 group is 4 ranks of one node, strided by the node's ranks / 4 (never crosses a node).
        if ep > 1:
            raise ValueError("NxD does not support expert parallelism with TP=4 on trn1")
        local = int(local_world_size) if local_world_size is not None else world
        per_node = local // tp
        if per_node < 1 or local % tp or dp % per_node:
            raise ValueError(
                f"trn1 TP=4 layout needs LOCAL_WORLD_SIZE ({local}) divisible by 4 and DP ({dp}) divisible by "
                f"LOCAL_WORLD_SIZE/4 ({per_node}), as NxD requires"
            )
        grid = ranks.reshape(pp, dp // per_node, cp, tp, per_node).swapaxes(-1, -2)
        exp = grid.reshape(pp, dp, ep, tp)
        nonexp = grid.reshape(pp, dp, cp, tp)
    else:
        exp = ranks.reshape(pp, edp, ep, tp)
        nonexp = ranks.reshape(pp, dp, cp, tp)
    ring = platform == "trn2" and (lnc_size, tp) in ((1, 64), (2, 32)) and not (lnc_size == 2 and world < 64)
    if ring:
        return _trn2_ring_groups(world, tp, pp, dp, cp, ep, edp, exp, local_world_size)
    return RankGroups(
        tp=_freeze(nonexp[p, d, c, :].tolist() for p in range(pp) for d in range(dp) for c in range(cp)),
        dp=_freeze(nonexp[p, :, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)),
        pp=_freeze(nonexp[:, d, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)),
        cp=_freeze(nonexp[p, d, :, t].tolist() for p in range(pp) for d in range(dp) for t in range(tp)),
        ep=_freeze(exp[p, e, :, t].tolist() for p in range(pp) for e in range(edp) for t in range(tp)),
        edp=_freeze(exp[p, :, e, t].tolist() for p in range(pp) for e in range(ep) for t in range(tp)),
    )


def _trn2_ring_groups(
    world: int, tp: int, pp: int, dp: int, cp: int, ep: int, edp: int, exp: np.ndarray, local: int | None
) -> RankGroups:
    """trn2's ascending-descending ring: a node's 4 rows of ranks, TP groups = rows (1+4) and (2+3)."""
    per_node = int(local) if local is not None else 64
    row = per_node // 4
    nodes = world // per_node
    tp_groups: list[list[int]] = []
    for node in range(nodes):
        base = node * per_node
        outer = [*range(base, base + row), *range(base + 3 * row, base + 4 * row)]
        inner = [*range(base + row, base + 2 * row), *range(base + 2 * row, base + 3 * row)]
        if per_node // tp == 1:
            tp_groups.append(outer + inner)
        else:
            tp_groups += [outer, inner]
    if len(tp_groups) != world // tp:
        raise ValueError(
            f"trn2 ring layout: {len(tp_groups)} TP groups for world {world} and TP={tp}; set LOCAL_WORLD_SIZE "
            "to the ranks per node"
        )

    def across(size: int, merge: int | None) -> list[list[int]]:
        if len(tp_groups) % size:
            raise ValueError(f"trn2 ring layout: {len(tp_groups)} TP groups are not divisible by {size}")
        out: list[list[int]] = []
        for i in range(0, len(tp_groups), size):
            chunk = tp_groups[i : i + size]
            if merge is not None:
                chunk = [[r for g in chunk[j : j + merge] for r in g] for j in range(0, len(chunk), merge)]
            out += [list(z) for z in zip(*chunk, strict=True)]
        return out

    singles = [[r] for r in range(world)]
    return RankGroups(
        tp=_freeze(tp_groups),
        cp=_freeze(across(cp, None)),
        dp=_freeze(across(dp * cp, cp) if dp > 1 else singles),
        pp=_freeze(across(pp * dp * cp, dp * cp) if pp > 1 else singles),
        ep=_freeze(
            [exp[p, e, :, t].tolist() for p in range(pp) for e in range(edp) for t in range(tp)] if ep > 1 else singles
        ),
        edp=_freeze(
            [exp[p, :, e, t].tolist() for p in range(pp) for e in range(ep) for t in range(tp)] if edp > 1 else singles
        ),
    )


@dataclass(frozen=True)
class Coordinates:
    """One rank's position in every group (what NxD's ``get_*_rank()`` getters return on that rank)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    edp: int


def _rank_table(world: int, groups: RankGroups) -> tuple[dict[str, dict[int, int]], dict[str, dict[int, int]]]:
    """(position of each rank in its group, index of its group) per kind; raises LayoutError unless each kind's
    groups split the world into equal groups with every rank exactly once."""
    position: dict[str, dict[int, int]] = {}
    group_index: dict[str, dict[int, int]] = {}
    for kind in _KINDS:
        pos: dict[int, int] = {}
        idx: dict[int, int] = {}
        lists = groups.of(kind)
        sizes = {len(g) for g in lists}
        if len(sizes) != 1:
            raise LayoutError(f"{kind.upper()} groups have different sizes {sorted(sizes)}: {list(lists)}")
        for gi, members in enumerate(lists):
            order = {m: i for i, m in enumerate(members if kind in _LIST_INDEXED else sorted(members))}
            for r in members:
                if not 0 <= r < world:
                    raise LayoutError(f"{kind.upper()} group {list(members)} names rank {r} outside world {world}")
                if r in pos:
                    raise LayoutError(f"rank {r} appears twice in the {kind.upper()} groups {list(lists)}")
                pos[r] = order[r]
                idx[r] = gi
        if len(pos) != world:
            missing = sorted(set(range(world)) - set(pos))
            raise LayoutError(f"{kind.upper()} groups leave ranks {missing[:16]} out of world {world}")
        position[kind], group_index[kind] = pos, idx
    return position, group_index


@dataclass(frozen=True)
class Topology:
    """The parallel layout in force plus this process's global rank.

    Construct from group lists (``Topology.from_groups``, what ``parallel_state.current_topology`` does), or
    from sizes alone for NxD's default row-major layout (``Topology(tp_size=2, dp_size=2, rank=1)``).
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    groups: RankGroups | None = None
    _position: dict[str, dict[int, int]] = field(default_factory=dict, repr=False, compare=False)
    _group_index: dict[str, dict[int, int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "cp_size", "ep_size", "local_world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {getattr(self, name)}")
        world = self.world_size
        if not 0 <= self.rank < world:
            raise ValueError(f"rank {self.rank} is outside a world of {world} ranks")
        if (self.dp_size * self.cp_size) % self.ep_size:
            raise ValueError(f"DP*CP = {self.dp_size}*{self.cp_size} is not divisible by EP = {self.ep_size}")
        groups = self.groups
        if groups is None:
            groups = build_nxd_groups(world, self.tp_size, self.pp_size, self.cp_size, self.ep_size)
            object.__setattr__(self, "groups", groups)
        expected = {
            "tp": self.tp_size,
            "pp": self.pp_size,
            "dp": self.dp_size,
            "cp": self.cp_size,
            "ep": self.ep_size,
            "edp": self.edp_size,
        }
        for kind, size in expected.items():
            lists = groups.of(kind)
            if not lists or any(len(g) != size for g in lists):
                raise LayoutError(
                    f"{kind.upper()} groups {[list(g) for g in lists][:8]} do not have the size {size} the parallel "
                    f"state reports ({self.describe()})"
                )
        position, group_index = _rank_table(world, groups)
        object.__setattr__(self, "_position", position)
        object.__setattr__(self, "_group_index", group_index)
        self._check_grid()

    def _check_grid(self) -> None:
        """Every rank has distinct (PP, DP, CP, TP) coordinates (and distinct (PP, EDP, EP, TP) ones with expert
        parallelism), and each TP/PP/EP/EDP group's members share their TP and PP ranks but their own: otherwise
        two ranks would write the same file. Without EP the expert groups are not consulted (trn2's ring layout
        pairs them inconsistently with its TP groups, and NxD uses them only for expert tensors)."""
        grids = [("pp", "dp", "cp", "tp")] + ([("pp", "edp", "ep", "tp")] if self.ep_size > 1 else [])
        for kinds in grids:
            seen: dict[tuple[int, ...], int] = {}
            for r in range(self.world_size):
                key = tuple(self._position[k][r] for k in kinds)
                if key in seen:
                    raise LayoutError(
                        f"ranks {seen[key]} and {r} both have {'/'.join(k.upper() for k in kinds)} coordinates {key}"
                        f" in the parallel state; its groups are inconsistent ({self.describe()})"
                    )
                seen[key] = r
        for kind in ("tp", "pp", "dp", "cp") + (("ep", "edp") if self.ep_size > 1 else ()):
            others = [k for k in ("tp", "pp") if k != kind]
            for members in self.groups.of(kind):  # type: ignore[union-attr]
                for k in others:
                    values = {self._position[k][r] for r in members}
                    if len(values) > 1:
                        raise LayoutError(
                            f"{kind.upper()} group {list(members)} mixes {k.upper()} ranks {sorted(values)}; the "
                            f"parallel state is inconsistent ({self.describe()})"
                        )

    @classmethod
    def from_groups(cls, groups: RankGroups, rank: int, *, local_rank: int = 0, local_world_size: int = 1) -> Topology:
        """The layout given by explicit group lists (sizes are the group lengths)."""
        groups = RankGroups(**{k: _freeze(groups.of(k)) for k in _KINDS})
        sizes = {k: len(groups.of(k)[0]) if groups.of(k) else 0 for k in _KINDS}
        return cls(
            tp_size=sizes["tp"],
            pp_size=sizes["pp"],
            dp_size=sizes["dp"],
            cp_size=sizes["cp"],
            ep_size=sizes["ep"],
            rank=rank,
            local_rank=local_rank,
            local_world_size=local_world_size,
            groups=groups,
        )

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size * self.cp_size

    @property
    def edp_size(self) -> int:
        """Expert-data-parallel size: ranks holding the same expert shard (DP*CP/EP)."""
        return self.dp_size * self.cp_size // self.ep_size

    # ----------------------------------------------------------- coordinates
    def coordinates(self, rank: int | None = None) -> Coordinates:
        """The coordinates of ``rank`` (default: this process) from the rank table."""
        r = self.rank if rank is None else rank
        return Coordinates(**{k: self._position[k][r] for k in _KINDS})

    @property
    def tp_rank(self) -> int:
        return self._position["tp"][self.rank]

    @property
    def dp_rank(self) -> int:
        return self._position["dp"][self.rank]

    @property
    def pp_rank(self) -> int:
        return self._position["pp"][self.rank]

    @property
    def cp_rank(self) -> int:
        return self._position["cp"][self.rank]

    @property
    def ep_rank(self) -> int:
        return self._position["ep"][self.rank]

    @property
    def edp_rank(self) -> int:
        return self._position["edp"][self.rank]

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def file_ep_rank(self) -> int | None:
        """The EP rank as NxD's file names carry it: only with expert parallelism."""
        return self.file_ep_rank_of(self.rank)

    def file_ep_rank_of(self, rank: int) -> int | None:
        """``file_ep_rank`` of any rank (a load's master works out which files each rank reads)."""
        return self._position["ep"][rank] if self.ep_size > 1 else None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank, from the rank table."""
        c = self.coordinates(rank)
        return (c.pp, c.dp, c.tp)

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at (pp, dp, tp[, cp]) in the rank table."""
        for r in range(self.world_size):
            c = self.coordinates(r)
            if (c.pp, c.dp, c.tp, c.cp) == (pp, dp, tp, cp):
                return r
        raise ValueError(f"no rank has PP={pp} DP={dp} TP={tp} CP={cp} in {self.describe()}")

    def group_ranks(self, kind: str, rank: int | None = None) -> list[int]:
        """Members of the ``kind`` group ("tp", "pp", "dp", "cp", "ep", "edp") that holds ``rank``, in rank order."""
        r = self.rank if rank is None else rank
        members = self.groups.of(kind)[self._group_index[kind][r]]  # type: ignore[union-attr]
        return sorted(members, key=lambda m: self._position[kind][m])

    def dp_group_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks with the same (TP, PP, CP) coordinate as ``rank`` (its DP group), in DP-rank order."""
        return self.group_ranks("dp", rank)

    @functools.cached_property
    def _by_tp_pp(self) -> dict[tuple[int, int], list[int]]:
        """Ranks per (PP, TP) coordinate, ordered (DP, CP): model replicas without EP, and ZeRO-1 groups with CP."""
        out: dict[tuple[int, int], list[int]] = {}
        for m in range(self.world_size):
            out.setdefault((self._position["pp"][m], self._position["tp"][m]), []).append(m)
        for members in out.values():
            members.sort(key=lambda m: (self._position["dp"][m], self._position["cp"][m]))
        return out

    def _tp_pp_peers(self, rank: int) -> list[int]:
        return list(self._by_tp_pp[(self._position["pp"][rank], self._position["tp"][rank])])

    def replica_ranks(self, rank: int | None = None) -> list[int]:
        """Ranks holding the same model file as ``rank``: same TP, PP (and EP) rank, i.e. its DP and CP replicas
        (NxD saves models over expert-data-parallel groups), ordered (DP, CP) or by expert-DP rank with EP; the
        first one writes a plain file."""
        r = self.rank if rank is None else rank
        if self.ep_size > 1:
            return self.group_ranks("edp", r)
        return self._tp_pp_peers(r)

    def replica_groups(self) -> list[list[int]]:
        """Every model replica group (see ``replica_ranks``), in one order every rank agrees on."""
        out: list[list[int]] = []
        seen: set[int] = set()
        for r in range(self.world_size):
            if r not in seen:
                group = self.replica_ranks(r)
                seen.update(group)
                out.append(group)
        return out

    @property
    def replica_rank(self) -> int:
        """This rank's position among its model replicas (0 writes plain model files)."""
        return self.replica_ranks().index(self.rank)

    def zero1_group_ranks(self, rank: int | None = None) -> list[int]:
        """The ZeRO-1 sharding group of ``rank``: its DP group, or DP x CP (DP-major) with context parallelism,
        as NxD's trainer builds it (``get_zero1_sharding_groups``)."""
        r = self.rank if rank is None else rank
        if self.cp_size == 1:
            return self.dp_group_ranks(r)
        return self._tp_pp_peers(r)

    @property
    def zero1_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def zero1_rank(self) -> int:
        """This rank's shard index in its ZeRO-1 group (the DP rank without context parallelism)."""
        return self.zero1_rank_of(self.rank)

    def zero1_rank_of(self, rank: int) -> int:
        """``zero1_rank`` of any rank."""
        return self.zero1_group_ranks(rank).index(rank)

    def describe(self) -> str:
        extra = (f" CP={self.cp_size}" if self.cp_size > 1 else "") + (
            f" EP={self.ep_size}" if self.ep_size > 1 else ""
        )
        return f"TP={self.tp_size} PP={self.pp_size} DP={self.dp_size}{extra} (world {self.world_size})"
