"""Loading a checkpoint into another TP, PP or DP layout than the one it was saved with.

Every tensor a target rank needs is assembled from the parts of the source shards it covers
(``format/sharding.py`` read plans), read by byte range (``load/reshard_sources.py``: the source files, their
integrity checks, the assembly). Parameters follow their names to the pipeline stage that holds them now;
optimizer state follows its parameter (``load/reshard_optimizer.py``: plain and ZeRO-1 state).

Everything that makes a layout impossible (no sharding recorded for a tensor, a layout the arithmetic does not
cover, shapes that disagree with the target) is found by ``plan_*`` before any tensor data is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import adapters
from nxd_ckpt.errors import FormatError, ReshardError, StateMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.format.sharding import Box, ShardingRecord, TensorSharding, pieces_to_read
from nxd_ckpt.format.sharding_marks import record_from_model
from nxd_ckpt.load.reshard_optimizer import OptimizerJob, Zero1Source, load_optimizer, load_zero1, plan_optimizer
from nxd_ckpt.load.reshard_sources import SourceFile, SourceFiles, SourceLayout, fill
from nxd_ckpt.optimizers import unwrap_optimizer
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import Storage

# ------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TensorJob:
    """One target tensor: its name, its sharding and the PP stage whose files hold it."""

    name: str
    sharding: TensorSharding
    stage: int


def plan_model(
    record: ShardingRecord,
    src_tp: int,
    src_pp: int,
    topo: Topology,
    target: Mapping[str, Any],
    *,
    strict: bool,
    where: str,
) -> list[TensorJob]:
    """The tensors this rank loads, checked (sharding known and re-shardable, target shapes right) before any
    data is read; tensors of the target without a record are an error under ``strict``, else skipped."""
    jobs = []
    for name, value in target.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name not in record and not strict:
            continue
        s = record.require(name, where)
        s.check(name, topo.tp_size, src_tp)
        stage = s.pp_stage or 0
        if stage >= src_pp:
            raise FormatError(
                f"{where}: tensor {name!r} is recorded on PP stage {stage}, but the checkpoint has {src_pp}"
            )
        want = s.local_shape(topo.tp_size)
        if tuple(value.shape) != want:
            raise StateMismatchError(
                f"{where}: tensor {name!r} has global shape {list(s.shape)}, so at TP={topo.tp_size} each rank "
                f"holds {list(want)}, but the model's is {list(value.shape)}"
            )
        jobs.append(TensorJob(name, s, stage))
    return jobs


def _checked(f: SourceFile, value: Any, name: str, want: tuple[int, ...]) -> torch.dtype:
    """The dtype of ``value``, after checking it is a tensor of the shape its sharding record says."""
    if not f.is_tensor(value):
        raise FormatError(f"{f.what}: {name!r} is a {type(value).__name__}, not a tensor")
    dtype, shape = f.meta(value)
    if shape != want:
        raise FormatError(
            f"{f.what}: tensor {name!r} has shape {list(shape)}, but its recorded sharding says {list(want)}; the "
            "checkpoint is damaged or its sharding record does not match it"
        )
    return dtype


def load_model(
    src: SourceLayout,
    jobs: Sequence[TensorJob],
    topo: Topology,
    files: SourceFiles,
    live: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's model state at its layout, assembled from the source model files: straight into the
    ``live`` model's CPU tensors where they fit (no second copy of the state), else into fresh memory."""
    live = live or {}
    out = {}
    for job in jobs:

        def file_of(tp_rank: int, job: TensorJob = job) -> SourceFile:
            return files.get(layout.model_file(src.tag, tp_rank, job.stage))

        def read(tp_rank: int, box: Box, job: TensorJob = job) -> torch.Tensor:
            f = file_of(tp_rank)
            return f.read_box(f.lookup((job.name,)), box)

        first = file_of(pieces_to_read(job.sharding, src.tp, topo.tp_size, topo.tp_rank)[0].src_rank)
        dtype = _checked(first, first.lookup((job.name,)), job.name, job.sharding.local_shape(src.tp))
        shape = job.sharding.local_shape(topo.tp_size)
        dest = live.get(job.name)
        if (
            dest is not None
            and dest.device.type == "cpu"
            and dest.dtype == dtype
            and tuple(dest.shape) == shape
            and dest.is_contiguous()
        ):
            tensor = dest.detach()  # the parameter's own memory (load_state_dict then copies it onto itself)
        else:
            tensor = torch.empty(shape, dtype=dtype)
        with torch.no_grad():
            out[job.name] = fill(tensor, job.sharding, src.tp, topo.tp_size, topo.tp_rank, read)
    return out


# ------------------------------------------------------------------------------------------- one load


def _target_order(model: Any, optimizer: Any, tp: int) -> tuple[list[str | None], list[list[int]]]:
    """The parameter name behind each of the target optimizer's state indices, and its groups' indices."""
    inner = unwrap_optimizer(optimizer)
    groups = getattr(inner, "param_groups", None)
    if not isinstance(model, torch.nn.Module) or not groups:
        raise ReshardError(
            "re-sharding optimizer state on load needs the model (a torch.nn.Module) and an optimizer with "
            "param_groups, to match each optimizer parameter to its name"
        )
    order = list(record_from_model(model, tp, optimizer=optimizer).optimizer_params.get(0, ()))
    index, ids = 0, []
    for g in groups:
        n = len(g.get("params", []))
        ids.append(list(range(index, index + n)))
        index += n
    return order, ids


class ReshardedLoad:
    """One rank's load at another TP/PP (and DP) layout, planned and checked on creation (nothing read but
    the structure of the files), then read by ``model_state`` / ``optimizer_state``."""

    def __init__(
        self,
        storage: Storage,
        tag: str,
        info: TagDescription,
        record: ShardingRecord,
        topo: Topology,
        model: Any,
        optimizer: Any,
        *,
        strict: bool,
        trusted: bool,
    ) -> None:
        self.topo = topo
        self.files = SourceFiles(storage, trusted=trusted)
        where = f"{storage.url}/{tag}"
        self.src = SourceLayout(
            tag, int(info.tp or 1), int(info.pp or 1), record, zero1_dp=info.zero1_dp_size, zero1_full=info.zero1_full
        )
        self.zero1 = bool(info.zero1)
        self.model_jobs: list[TensorJob] = []
        self.live: dict[str, torch.Tensor] = {}
        self.opt_jobs: list[OptimizerJob] = []
        self.groups: list[list[int]] = []
        if model is not None:
            if isinstance(model, torch.nn.Module):
                target: Mapping[str, Any] = adapters.model_state(model)
                self.live = dict(model.named_parameters(remove_duplicate=False))
                self.live.update(model.named_buffers(remove_duplicate=False))
            elif self.src.pp == topo.pp_size:  # a dict target: this stage's tensors, at their new shapes
                target = {
                    n: torch.empty(record.tensors[n].local_shape(topo.tp_size), device="meta")
                    for n in record.names_on_stage(topo.pp_rank)
                }
            else:
                raise ReshardError(
                    f"loading {where} at another PP size needs the model (a torch.nn.Module), to know which "
                    "parameters this stage holds now"
                )
            self.model_jobs = plan_model(record, self.src.tp, self.src.pp, topo, target, strict=strict, where=where)
        if optimizer is not None:
            if self.zero1 and info.zero1_dp_size is None and not info.zero1_full:
                raise ReshardError(
                    f"{where}: the ZeRO-1 optimizer files' DP size is not known; it cannot be re-sharded"
                )
            order, self.groups = _target_order(model, optimizer, topo.tp_size)
            self.opt_jobs = plan_optimizer(record, self.src.tp, self.src.pp, topo, order, where)

    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's model state at its layout (into the live model's tensors where they fit)."""
        return load_model(self.src, self.model_jobs, self.topo, self.files, self.live)

    def optimizer_state(self) -> dict:
        """This rank's optimizer state at its layout: ZeRO-1 shards when the tag holds ZeRO-1 state, else plain."""
        if self.zero1:
            return load_zero1(Zero1Source(self.src, self.topo, self.files), self.opt_jobs, self.groups)
        return load_optimizer(self.src, self.opt_jobs, self.groups, self.topo, self.files)
