"""Whole-model weights from outside (a safetensors file or set, or a DCP checkpoint) as an NxD-layout tag.

The tag is what ``save_checkpoint`` writes for the model at the chosen TP/PP: ``model/dp_rank_00_tp_rank_TT_
pp_rank_PP.pt`` files (plain or xser), ``nxd_ckpt.json`` with the sharding record, a manifest, ``checkpoint``
first and ``done`` last. Model only: there is no optimizer state to import, and DP does not change the files
(DP replicas share one model file), so the tag loads at any DP size; start with ``load_checkpoint(...,
model=model)`` and a fresh optimizer. How each tensor is split over TP ranks comes from a model built at the
target TP (its parameters' NxD attributes) or a name-pattern spec.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from nxd_ckpt.errors import CheckpointError, ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format import sharding as shd
from nxd_ckpt.format import sharding_marks as marks
from nxd_ckpt.format.metadata import TagMetadata
from nxd_ckpt.log import format_bytes
from nxd_ckpt.tools import dcp_io, model_writer, offline_tag
from nxd_ckpt.tools.export import RenameMap
from nxd_ckpt.tools.safetensors_io import SafetensorsSource, TensorEntry


@dataclass
class ImportReport:
    """What an import did: the source and its format, the target layout, tensors and bytes, files, the time."""

    source: str
    format: str
    out: str
    tp: int
    pp: int
    xser: bool
    tensors: int = 0
    nbytes: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"imported {self.tensors} tensors ({format_bytes(self.nbytes)}) from {self.format} {self.source} as "
            f"TP={self.tp} PP={self.pp} ({'xser' if self.xser else 'plain'}, model only): {len(self.files)} model "
            f"files, {self.seconds:.2f} s -> {self.out}"
        )


def detect_format(path: str) -> str:
    """``"dcp"`` for a directory with DCP's ``.metadata``, else ``"safetensors"``."""
    if os.path.isfile(os.path.join(path, layout.DCP_METADATA_FILE)):
        return "dcp"
    return "safetensors"


def _source_record(
    entries: list[TensorEntry], sharding: shd.ShardingRecord | Mapping[str, marks.SpecValue] | torch.nn.Module, tp: int
) -> shd.ShardingRecord:
    """Whole-tensor shardings of the source's tensors from the caller's record, spec or target-TP model."""
    shapes = {e.name: e.shape for e in entries}
    if isinstance(sharding, torch.nn.Module):
        base = marks.record_from_model(sharding, tp)
        for e in entries:
            s = base.require(e.name, "the model")
            if s.shape != e.shape:
                raise ReshardError(
                    f"tensor {e.name!r} is {list(e.shape)} in the source, but the model (at TP={tp}) has it as "
                    f"{list(s.shape)} in whole"
                )
        extra = sorted(set(base.tensors) - set(shapes))
        if extra:
            raise ReshardError(
                f"the source has no tensor for the model's {', '.join(repr(n) for n in extra[:5])}"
                + (" ..." if len(extra) > 5 else "")
                + "; rename the source's tensors (--rename) or check that it is this model's"
            )
    elif isinstance(sharding, shd.ShardingRecord):
        base = sharding
    elif isinstance(sharding, Mapping):
        # record_from_spec reads shapes as per-rank ones at ``tp``: only its dims, strides and matching are used
        base = marks.record_from_spec(sharding, shapes, tp)
    else:
        raise TypeError(f"sharding must be a ShardingRecord, a pattern mapping or a model, got {type(sharding)}")
    tensors = {}
    for e in entries:
        s = base.require(e.name, "the sharding spec")
        tensors[e.name] = shd.TensorSharding(
            e.shape, s.partition_dim, s.stride, 1, None, s.rank_ordering, s.unsupported
        )
    return shd.ShardingRecord(tensors)


def import_weights(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str,
    *,
    tp: int = 1,
    pp: int = 1,
    sharding: shd.ShardingRecord | Mapping[str, marks.SpecValue] | torch.nn.Module | None = None,
    stage_of: Callable[[str], int | None] | None = None,
    format: str | None = None,
    rename: RenameMap | None = None,
    use_xser: bool = False,
    allow_pickle: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ImportReport:
    """Write ``out_dir/tag``: the weights at ``source`` laid out for TP=``tp``, PP=``pp`` (any DP).

    Args:
        source: a ``.safetensors`` file, a directory of a safetensors set (with or without its index), or a DCP
            checkpoint directory.
        sharding: a model built at TP=``tp`` (its parameters carry NxD's attributes), a ``ShardingRecord``, or
            name patterns -> partition dim / (dim, stride) / None; required at TP>1 (at TP=1 all are whole).
        stage_of: tensor name -> PP stage (``model_writer.stage_map`` of patterns); required at PP>1.
        format: ``"safetensors"`` or ``"dcp"`` (default: by what ``source`` holds).
        rename: renames applied to the source's names first (e.g. Hugging Face names -> the model's).
        use_xser: write xser model files (one file per tensor) instead of plain ``torch.save`` files.
        allow_pickle: DCP only: unpickle its ``.metadata`` without restricting classes (trusted sources only).
    """
    start = time.perf_counter()
    source = os.path.abspath(os.fspath(source))
    if not os.path.exists(source):
        raise CheckpointError(f"{source}: no such file or directory")
    fmt = format or detect_format(source)
    src, raw = _open_source(source, fmt, allow_pickle)
    names = (rename or RenameMap()).apply([e.name for e in raw])
    entries = [TensorEntry(names[e.name], e.dtype, e.shape) for e in raw]
    original = {names[e.name]: e.name for e in raw}
    record = _source_record(entries, _check_layout_inputs(sharding, stage_of, tp, pp), tp)
    target = model_writer.plan(entries, record, tp, pp, stage_of, where=source)
    out_root = os.path.abspath(os.fspath(out_dir))
    storage = offline_tag.begin(out_root, tag, overwrite_hint="")
    report = ImportReport(source, fmt, os.path.join(out_root, tag), tp, pp, use_xser)

    def read(name: str) -> torch.Tensor:
        tensor = src.read(original[name])
        report.tensors += 1
        report.nbytes += tensor.numel() * tensor.element_size()
        return tensor

    try:
        report.files = model_writer.write_model(storage, tag, target, read, xser=use_xser, progress=progress)
        offline_tag.commit(storage, _metadata(tag, target, source, fmt, use_xser))
    except BaseException:
        shutil.rmtree(os.path.join(out_root, tag), ignore_errors=True)  # never complete ('done' comes last)
        raise
    report.seconds = time.perf_counter() - start
    return report


def _open_source(
    source: str, fmt: str, allow_pickle: bool
) -> tuple[SafetensorsSource | dcp_io.DcpSource, list[TensorEntry]]:
    """The reader of ``source`` in format ``fmt`` and its tensors' names, dtypes and shapes (at least one)."""
    if fmt == "dcp":
        src: SafetensorsSource | dcp_io.DcpSource = dcp_io.DcpSource(source, allow_pickle=allow_pickle)
        raw = [TensorEntry(n, d, s) for n, d, s in src.entries()]
    elif fmt == "safetensors":
        src = SafetensorsSource(source)
        raw = src.entries()
    else:
        raise ValueError(f"unknown import format {fmt!r}; choose safetensors or dcp")
    if not raw:
        raise CheckpointError(f"{source} holds no tensors to import")
    return src, raw


def _check_layout_inputs(
    sharding: shd.ShardingRecord | Mapping[str, marks.SpecValue] | torch.nn.Module | None,
    stage_of: Callable[[str], int | None] | None,
    tp: int,
    pp: int,
) -> shd.ShardingRecord | Mapping[str, marks.SpecValue] | torch.nn.Module:
    """``sharding`` (every tensor whole when None at TP=1); ReshardError when TP>1 lacks it or PP>1 a stage map."""
    if sharding is None:
        if tp > 1:
            raise ReshardError(
                f"importing at TP={tp} needs to know along which dimension each tensor is split: pass a sharding spec "
                '(--sharding-spec FILE: name pattern -> partition dim, e.g. {"*.qkv_proj.weight": [0, 3], '
                '"*.o_proj.weight": 1, "*": null}) or, from Python, a model built at the target TP'
            )
        sharding = {"*": None}
    if pp > 1 and stage_of is None:
        raise ReshardError(
            f"importing at PP={pp} needs a stage map (--stage-map FILE: JSON of name pattern -> PP stage, e.g. "
            '{"embed.*": 0, "layers.[0-3].*": 0, "*": 1})'
        )
    return sharding


def _metadata(tag: str, target: model_writer.ModelPlan, source: str, fmt: str, use_xser: bool) -> TagMetadata:
    """The imported tag's nxd_ckpt.json: a model-only tag at the target layout, with its sharding record."""
    return TagMetadata(
        tag=tag,
        created_at=time.time(),
        tp=target.tp,
        pp=target.pp,
        xser=use_xser,
        items=("model",),
        torch_version=torch.__version__,
        converted_from={"path": source, "format": fmt},
        sharding=target.record,
    )
