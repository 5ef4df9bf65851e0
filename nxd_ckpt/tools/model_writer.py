"""Model files of an NxD-layout tag at a chosen TP/PP, written from whole tensors one at a time.

Each target file (``model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt``, plain or xser) is laid out first from the
tensors' shapes alone (``load/zero1_io``'s shard writers: a plain file reserved with ``skip_data`` and filled
through a shared mapping, an xser file one tensor file at a time); then for each whole tensor, every TP rank's
part (``format/sharding.split``) goes straight into its file. Memory: the whole tensor and one part of it.
Which stage holds a tensor and how it is split are the caller's (``ModelPlan``); the tag's commit is
``tools/offline_tag``'s.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nxd_ckpt.errors import ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format import sharding as shd
from nxd_ckpt.load.zero1_io import PlainShardWriter, XserShardWriter
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.tools.safetensors_io import TensorEntry


@dataclass(frozen=True)
class ModelPlan:
    """Where every tensor goes at the target layout: its sharding (global shape, dim, stride, stage)."""

    tp: int
    pp: int
    entries: tuple[TensorEntry, ...]
    record: shd.ShardingRecord
    """Target shardings: ``num_partitions`` = ``tp`` for split tensors, ``pp_stage`` set for every tensor."""

    def names_of(self, pp: int) -> list[TensorEntry]:
        return [e for e in self.entries if (self.record.require(e.name).pp_stage or 0) == pp]


def stage_map(patterns: Mapping[str, int]) -> Callable[[str], int | None]:
    """A tensor name -> PP stage function from ``{"fnmatch pattern": stage}`` (first match wins)."""

    def stage_of(name: str) -> int | None:
        for pattern, stage in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                return int(stage)
        return None

    return stage_of


def plan(
    entries: Sequence[TensorEntry],
    source: shd.ShardingRecord,
    tp: int,
    pp: int,
    stage_of: Callable[[str], int | None] | None = None,
    *,
    where: str = "the source",
) -> ModelPlan:
    """The target layout of ``entries`` (whose whole-tensor shardings ``source`` gives) at ``tp``/``pp``.

    Stages: ``stage_of(name)`` when given (None for a name is an error), else stage 0 at PP=1, else the source's
    stage when the source has ``pp`` stages too. Every tensor is checked (divisible, supported) before anything
    is written; the first problem raises ReshardError naming the tensor.
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"TP and PP must be at least 1, got TP={tp} PP={pp}")
    source_pp = 1 + max(((source.require(e.name, where).pp_stage or 0) for e in entries), default=0)
    tensors: dict[str, shd.TensorSharding] = {}
    for e in entries:
        s = source.require(e.name, where)
        if stage_of is not None:
            stage = stage_of(e.name)
            if stage is None:
                raise ReshardError(f"the stage map gives no PP stage for tensor {e.name!r}; add a pattern for it")
        elif pp == 1:
            stage = 0
        elif source_pp == pp:
            stage = s.pp_stage or 0
        else:
            raise ReshardError(
                f"{where} has {source_pp} PP stage(s); which of the {pp} target stages holds each tensor depends on "
                "how the model is cut into stages, so give a stage map (--stage-map FILE: JSON of name pattern -> "
                'stage, e.g. {"layers.[0-7].*": 0, "*": 1})'
            )
        if not 0 <= stage < pp:
            raise ReshardError(f"the stage map puts tensor {e.name!r} on PP stage {stage}, outside PP={pp}")
        s.check(e.name, tp)
        target = shd.TensorSharding(
            e.shape,
            s.partition_dim,
            s.stride if s.partition_dim is not None else 1,
            tp if s.partition_dim is not None else 1,
            stage,
        )
        tensors[e.name] = target
    for stage in range(pp):
        if not any((t.pp_stage or 0) == stage for t in tensors.values()):
            raise ReshardError(f"PP stage {stage} of the target layout would hold no tensor; check the stage map")
    return ModelPlan(tp, pp, tuple(entries), shd.ShardingRecord(tensors))


def write_model(
    storage: LocalStorage,
    tag: str,
    model_plan: ModelPlan,
    read: Callable[[str], torch.Tensor],
    *,
    xser: bool,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write every model file of ``model_plan`` into ``storage``'s ``tag``, reading each whole tensor once with
    ``read(name)``; return the files' paths. On an error the files written so far are removed."""
    writers: dict[tuple[int, int], PlainShardWriter | XserShardWriter] = {}
    try:
        for pp in range(model_plan.pp):
            names = model_plan.names_of(pp)
            for tp in range(model_plan.tp):
                skeleton = {
                    e.name: torch.empty(model_plan.record.require(e.name).local_shape(model_plan.tp), dtype=e.dtype)
                    for e in names
                }
                path = layout.model_file(tag, tp, pp)
                if xser:
                    writers[(tp, pp)] = XserShardWriter(storage, path, skeleton)
                else:
                    writers[(tp, pp)] = PlainShardWriter(f"{storage.root}/{path}", skeleton, [(e.name,) for e in names])
                del skeleton
        for e in model_plan.entries:
            s = model_plan.record.require(e.name)
            full = read(e.name)
            if tuple(full.shape) != e.shape or full.dtype != e.dtype:
                raise ReshardError(
                    f"tensor {e.name!r} came out as {full.dtype} {list(full.shape)}, but the source describes it as "
                    f"{e.dtype} {list(e.shape)}; the source is inconsistent"
                )
            for tp in range(model_plan.tp):
                w = writers[(tp, s.pp_stage or 0)]
                if isinstance(w, PlainShardWriter):  # each span straight from the whole tensor into the file
                    target = w.target((e.name,))
                    _fill(target, full, s, model_plan.tp, tp)
                    w.done_with(target)
                    del target
                else:
                    whole = s.replicated or model_plan.tp == 1
                    part = full if whole else shd.split(full, s, model_plan.tp, tp)
                    w.write_tensor((e.name,), part)
                    del part
            if progress is not None:
                progress(full.numel() * full.element_size())
            del full
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return [layout.model_file(tag, tp, pp) for pp in range(model_plan.pp) for tp in range(model_plan.tp)]


def _fill(target: torch.Tensor, full: torch.Tensor, s: shd.TensorSharding, tp: int, rank: int) -> None:
    """Copy TP rank ``rank``'s part of ``full`` into ``target`` span by span (no intermediate copy)."""
    if s.partition_dim is None:
        target.copy_(full)
        return
    dim = s.partition_dim
    for span in shd.spans(s, tp, rank):
        n = span.stop - span.start
        target.narrow(dim, span.local_start, n).copy_(full.narrow(dim, span.start, n))
