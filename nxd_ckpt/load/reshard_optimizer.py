"""Optimizer state in a re-sharded load (``load/reshard.py``): plain (torch) state follows its parameter (state
with the parameter's shape is re-sharded like it; ``step`` and other scalars are copied); ZeRO-1 state is first the
TP-local tensor cut in DP chunks along dim 0 (``load/zero1.py``), so a ZeRO-1 shard of the new layout reads only
the rows and columns it covers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt.errors import FormatError, ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format.sharding import Box, ShardingRecord, TensorSharding, pieces_to_read
from nxd_ckpt.load import zero1
from nxd_ckpt.load.reshard_sources import SourceFile, SourceFiles, SourceLayout, chunked_reader, fill
from nxd_ckpt.ranks.topology import Topology


@dataclass(frozen=True)
class OptimizerJob:
    """Target optimizer index ``index`` takes the state of parameter ``name`` (source stage and index)."""

    index: int
    name: str
    sharding: TensorSharding
    stage: int
    src_index: int


def plan_optimizer(
    record: ShardingRecord, src_tp: int, src_pp: int, topo: Topology, target_order: Sequence[str | None], where: str
) -> list[OptimizerJob]:
    """Which saved optimizer state each of this rank's optimizer indices takes, checked before reading."""
    jobs = []
    for index, name in enumerate(target_order):
        if name is None:
            raise ReshardError(
                f"optimizer parameter {index} is not a parameter of the model passed to load_checkpoint, so its "
                "state cannot be matched to the saved state at another layout"
            )
        s = record.require(name, where)
        s.check(name, topo.tp_size, src_tp)
        stage = s.pp_stage or 0
        order = record.optimizer_params.get(stage)
        if order is None:
            raise ReshardError(
                f"{where} does not record the optimizer's parameter order of PP stage {stage}, so optimizer state "
                "cannot be re-sharded; load the model alone (and start the optimizer fresh)"
            )
        if name not in order:
            raise ReshardError(f"{where}: parameter {name!r} had no optimizer state on PP stage {stage}")
        jobs.append(OptimizerJob(index, name, s, stage, order.index(name)))
    return jobs


def _groups(
    first: SourceFile, target_groups: Sequence[Sequence[int]], where: str, key: str = "param_groups"
) -> list[dict]:
    """The saved parameter groups (hyperparameters) with this optimizer's indices; ReshardError when their
    number differs."""
    saved = first.value(first.lookup((key,)))
    if not isinstance(saved, list) or len(saved) != len(target_groups):
        raise ReshardError(
            f"{where}: the saved optimizer has {len(saved) if isinstance(saved, list) else '?'} parameter groups, "
            f"this one {len(target_groups)}; re-sharding keeps the groups"
        )
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(ids)}
        for g, ids in zip(saved, target_groups, strict=True)
    ]


def _walk_slots(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of a (nested) optimizer state entry, with its key path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_slots(v, (*path, k))
    else:
        yield path, obj


def _set(tree: dict, path: tuple[Any, ...], value: Any) -> None:
    """Set ``value`` at key path ``path`` of ``tree``, making the dicts on the way."""
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_optimizer(
    src: SourceLayout,
    jobs: Sequence[OptimizerJob],
    target_groups: Sequence[Sequence[int]],
    topo: Topology,
    files: SourceFiles,
) -> dict:
    """This rank's plain (torch) optimizer state at its layout: state shaped like the parameter is re-sharded
    like it, the rest (``step``) copied from one source."""
    where = f"{files.storage.url}/{src.tag}"
    state: dict[int, dict] = {}
    first_file = None
    for job in jobs:

        def path_of(tp_rank: int, job: OptimizerJob = job) -> str:
            return layout.optim_file(src.tag, 0, tp_rank, job.stage)

        base = files.get(path_of(pieces_to_read(job.sharding, src.tp, topo.tp_size, topo.tp_rank)[0].src_rank))
        first_file = first_file or base
        if not base.has(("state", job.src_index)):
            continue
        entry: dict = {}
        src_local = job.sharding.local_shape(src.tp)
        for slot, value in _walk_slots(base.lookup(("state", job.src_index))):
            if base.is_tensor(value) and base.meta(value)[1] == src_local and src_local:
                keys = ("state", job.src_index, *slot)

                def read(tp_rank: int, box: Box, keys: tuple = keys, path_of: Callable = path_of) -> torch.Tensor:
                    f = files.get(path_of(tp_rank))
                    return f.read_box(f.lookup(keys), box)

                out = torch.empty(job.sharding.local_shape(topo.tp_size), dtype=base.meta(value)[0])
                _set(entry, slot, fill(out, job.sharding, src.tp, topo.tp_size, topo.tp_rank, read))
            else:
                _set(entry, slot, base.value(value))
        state[job.index] = entry
    if first_file is None:
        first_file = files.get(layout.optim_file(src.tag, 0, 0, 0))
    return {"state": state, "param_groups": _groups(first_file, target_groups, where)}


@dataclass(frozen=True)
class Zero1Source:
    """The ZeRO-1 files of a tag, re-cut for this rank: its DP rows of its TP part of a parameter's state."""

    src: SourceLayout
    topo: Topology
    files: SourceFiles

    def paths(self, tp_rank: int, stage: int) -> list[str]:
        """The files holding TP rank ``tp_rank``'s state of ``stage``, in DP order (one when saved full)."""
        src = self.src
        if src.zero1_full:
            return [layout.full_optim_file(src.tag, tp_rank, stage)]
        return [layout.optim_file(src.tag, d, tp_rank, stage) for d in range(int(src.zero1_dp or 1))]

    def base_file(self, job: OptimizerJob) -> SourceFile:
        """The first file this rank's part of ``job`` is read from (its structure describes every slot)."""
        first = pieces_to_read(job.sharding, self.src.tp, self.topo.tp_size, self.topo.tp_rank)[0]
        return self.files.get(self.paths(first.src_rank, job.stage)[0])

    def recut(self, job: OptimizerJob, keys: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor at ``keys`` of ``job``'s parameter, as this rank's padded ZeRO-1 shard."""
        topo = self.topo
        src_local = job.sharding.local_shape(self.src.tp)
        dst_local = job.sharding.local_shape(topo.tp_size)
        rows = zero1.shard_rows(dst_local[0], topo.zero1_size, topo.zero1_rank)
        readers: dict[int, Callable[[Box], torch.Tensor]] = {}

        def read(tp_rank: int, box: Box) -> torch.Tensor:
            if tp_rank not in readers:
                chunks = [(f, f.lookup(keys)) for f in (self.files.get(p) for p in self.paths(tp_rank, job.stage))]
                readers[tp_rank] = chunked_reader(src_local[0], chunks)
            return readers[tp_rank](box)

        out = torch.zeros(zero1.shard_shape(dst_local, topo.zero1_size), dtype=dtype)
        fill(out.narrow(0, 0, rows[1] - rows[0]), job.sharding, self.src.tp, topo.tp_size, topo.tp_rank, read, rows)
        return out

    def entry(self, job: OptimizerJob, base: SourceFile) -> dict:
        """``job``'s base-state entry: sharded slots re-cut, the others (step counts...) as saved."""
        entry: dict = {}
        for slot, value in _walk_slots(base.lookup((zero1.BASE_STATE, job.src_index))):
            keys = (zero1.BASE_STATE, job.src_index, *slot)
            if base.is_tensor(value) and zero1.is_shard_slot(keys, len(base.meta(value)[1])):
                _set(entry, slot, self.recut(job, keys, base.meta(value)[0]))
            else:
                _set(entry, slot, base.value(value))
        return entry


def load_zero1(source: Zero1Source, jobs: Sequence[OptimizerJob], target_groups: Sequence[Sequence[int]]) -> dict:
    """This rank's ZeRO-1 optimizer state (its DP chunk of every TP-local parameter) at its layout."""
    src, files = source.src, source.files
    base_state: dict[int, dict] = {}
    shape_info: dict[int, list[int]] = {}
    masters: dict[int, torch.Tensor] = {}
    first_file: SourceFile | None = None
    has_masters = False
    for job in jobs:
        base = source.base_file(job)
        first_file = first_file or base
        saved_shape = tuple(int(d) for d in base.value(base.lookup((zero1.SHAPE_INFO, job.src_index))))
        if saved_shape != job.sharding.local_shape(src.tp):
            raise FormatError(
                f"{base.what}: shape_info of {job.name!r} is {list(saved_shape)}, but its recorded sharding says "
                f"{list(job.sharding.local_shape(src.tp))}"
            )
        shape_info[job.index] = list(job.sharding.local_shape(source.topo.tp_size))
        base_state[job.index] = source.entry(job, base)
        if base.has((zero1.MASTER_WEIGHTS, job.src_index)):
            has_masters = True
            keys = (zero1.MASTER_WEIGHTS, job.src_index)
            masters[job.index] = source.recut(job, keys, base.meta(base.lookup(keys))[0])
    if first_file is None:
        first_file = files.get(source.paths(0, 0)[0])
    out: dict[str, Any] = {}
    for key, value in first_file.structure.items():
        if key not in (zero1.BASE_STATE, zero1.SHAPE_INFO, zero1.MASTER_WEIGHTS, "param_groups"):
            out[key] = first_file.value(value)
    out["param_groups"] = _groups(first_file, target_groups, f"{files.storage.url}/{src.tag}")
    out[zero1.BASE_STATE] = base_state
    out[zero1.SHAPE_INFO] = shape_info
    if has_masters:
        out[zero1.MASTER_WEIGHTS] = masters
    return out
