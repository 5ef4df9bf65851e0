"""Offline re-sharding of a tag to another TP/PP/DP layout: ``nxd-ckpt reshard``.

* Only DP changes (TP and PP kept): model files do not depend on DP, so this is the ZeRO-1 converter's job
  (``tools/convert_zero1``: optimizer shards re-cut for the new DP size, everything else carried over); a
  replicated optimizer does not depend on DP either, so the tag is copied (verified) under the new DP.
* TP or PP changes: every model tensor is read whole once (``tools/model_source``: TP shards merged, verified
  reads) and written straight into the target files (``tools/model_writer``), one tensor at a time. Scheduler and
  user content are carried over. Optimizer state is not re-sharded offline: refused unless ``model_only``, which
  writes a model-only tag (``load_checkpoint`` re-shards ZeRO-1 and replicated optimizers online; see the guide).

The output is a new tag (never an existing one: refused), written like a save: ``checkpoint`` first, a
manifest, ``nxd_ckpt.json`` with the new layout and sharding record, ``done`` last; removed again on failure.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointError, ReshardError
from nxd_ckpt.format import layout
from nxd_ckpt.format.metadata import TagMetadata
from nxd_ckpt.inspection import Checkpoint
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage.local import atomic_file
from nxd_ckpt.tools import model_writer, offline_tag
from nxd_ckpt.tools.model_source import CheckpointModel, ShardingSource, VerifyOnceStorage

logger = logging.getLogger("nxd_ckpt.reshard")


@dataclass
class ReshardReport:
    """What a re-shard did: the layouts before and after, tensors and bytes written, the files, the time."""

    source: str
    out: str
    src: tuple[int | None, int, int]
    """(DP, TP, PP) of the source."""
    dst: tuple[int | None, int, int]
    model_only: bool = False
    tensors: int = 0
    nbytes: int = 0
    largest_tensor_bytes: int = 0
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        def text(lay: tuple[int | None, int, int]) -> str:
            return f"DP={lay[0] if lay[0] is not None else 'any'} TP={lay[1]} PP={lay[2]}"

        what = " (model only: the optimizer state was not carried)" if self.model_only else ""
        return (
            f"re-sharded {text(self.src)} -> {text(self.dst)}{what}: {self.tensors} tensors, "
            f"{format_bytes(self.nbytes)}, {len(self.files)} model files, {self.seconds:.2f} s -> {self.out}"
        )


def reshard(
    ckpt: Checkpoint,
    out_dir: str | os.PathLike[str],
    out_tag: str | None = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    sharding: ShardingSource = None,
    stage_of: Callable[[str], int | None] | None = None,
    model_only: bool = False,
    num_workers: int = 1,
    param_order: Mapping[int, Sequence[str]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReshardReport:
    """Write ``ckpt`` re-sharded for TP=``tp``, PP=``pp``, DP=``dp`` (None: keep) as ``out_dir/out_tag``.

    Args:
        ckpt: the source tag (local; ``open_checkpoint``).
        out_dir: the checkpoint directory to write the new tag into; the tag must not exist there.
        sharding: for source tags without a sharding record at TP>1 (written by NxD): a spec, record or model.
        stage_of: tensor name -> target PP stage, required when PP changes to a value above 1.
        model_only: write the model (plus scheduler and user content) only, dropping the optimizer state;
            required when TP or PP changes on a tag with optimizer state.
        num_workers: DP-only changes: (TP, PP) coordinates converted in parallel.
        param_order: for ZeRO-1 state NxD saved through DCP (``use_zero1_dcp=True``): per PP stage, the parameter
            names in the optimizer's order (``tools/zero1_dcp.param_order_of(model, optimizer)``), which DCP's
            files do not hold.
    """
    start = time.perf_counter()
    _check_request(ckpt, tp, pp, dp)
    desc = ckpt.description()
    if desc.tp is None or desc.pp is None:
        raise CheckpointError(f"{ckpt.url} has no model or optimizer files to tell its layout")
    src = (desc.dp, desc.tp, desc.pp)
    dst_tp, dst_pp = tp or desc.tp, pp or desc.pp
    out_root, out_tag = _new_tag(ckpt, out_dir, out_tag)
    same_model_layout = (dst_tp, dst_pp) == (desc.tp, desc.pp)
    dcp_optim = ckpt.storage.exists(layout.tag_path(ckpt.tag, layout.OPTIM_DIR, layout.DCP_METADATA_FILE))
    if dcp_optim and same_model_layout and not model_only:
        return _reshard_zero1_dcp(ckpt, desc, out_root, out_tag, dp, param_order, src, start)
    if dcp_optim and not model_only:
        raise ReshardError(
            f"{ckpt.url}/{layout.OPTIM_DIR} holds ZeRO-1 state in torch Distributed Checkpoint format (NxD's "
            "use_zero1_dcp=True), which reshard converts to NxD's per-rank files at the same TP and PP only "
            "(--dp K --param-order FILE); pass --model-only to re-shard the model (and scheduler, user content) "
            "without it"
        )
    if same_model_layout:
        return _reshard_dp(ckpt, desc, out_root, out_tag, dp, model_only, num_workers, src, start)
    has_optimizer = "optimizer" in desc.saved_items or "optimizer" in desc.present_items or dcp_optim
    if has_optimizer and not model_only:
        raise ReshardError(
            f"{ckpt.url} holds optimizer state, which reshard does not move to another TP/PP layout offline; "
            f"pass --model-only to write the model (and scheduler, user content) for TP={dst_tp} PP={dst_pp}, or "
            "load the tag at the new layout with load_checkpoint, which re-shards the optimizer as it loads"
        )
    model = CheckpointModel(ckpt, sharding)
    target = model_writer.plan(model.entries(), model.record, dst_tp, dst_pp, stage_of, where=ckpt.url)
    out_tag_dir = os.path.join(out_root, out_tag)
    report = ReshardReport(ckpt.url, out_tag_dir, src, (None, dst_tp, dst_pp), model_only=has_optimizer)
    _write_model(ckpt, desc, model, target, out_root, out_tag, report, progress)
    report.seconds = time.perf_counter() - start
    logger.info("%s", report.summary())
    return report


def _check_request(ckpt: Checkpoint, tp: int | None, pp: int | None, dp: int | None) -> None:
    """CheckpointError for a source on remote storage, ValueError for a size that is not a whole number >= 1."""
    if ckpt.storage.local_path("") is None:
        raise CheckpointError(
            f"{ckpt.url}: reshard reads local checkpoints; copy the tag to local disk first (or use convert-zero1, "
            "which streams S3 tags through local scratch space, for a DP change)"
        )
    for name, value in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")


def _new_tag(ckpt: Checkpoint, out_dir: str | os.PathLike[str], out_tag: str | None) -> tuple[str, str]:
    """(checkpoint directory, tag) of the output: a valid tag name (default: the input's) that does not exist yet
    and is not the input itself."""
    out_tag = layout.validate_tag(out_tag or ckpt.tag)
    out_root = os.path.abspath(os.fspath(out_dir))
    out_tag_dir = os.path.join(out_root, out_tag)
    in_tag_dir = os.path.join(ckpt.storage.local_path(""), ckpt.tag)
    if os.path.realpath(out_tag_dir) == os.path.realpath(in_tag_dir):
        raise ValueError(f"the output {out_tag_dir} is the input tag; write the re-sharded tag to a new one")
    if os.path.lexists(out_tag_dir):
        raise CheckpointError(f"{out_tag_dir} already exists; reshard writes a new tag, choose another --out/--out-tag")
    return out_root, out_tag


def _write_model(
    ckpt: Checkpoint,
    desc: Any,
    model: CheckpointModel,
    target: model_writer.ModelPlan,
    out_root: str,
    out_tag: str,
    report: ReshardReport,
    progress: Callable[[int], None] | None,
) -> None:
    """TP or PP changes: the model one tensor at a time into the ``target`` files, scheduler and user content
    carried over, committed ('done' last); the tag is removed again on failure. Counts into ``report``."""
    out_tag_dir = os.path.join(out_root, out_tag)
    storage = offline_tag.begin(out_root, out_tag, overwrite_hint="")
    report.largest_tensor_bytes = max((e.nbytes for e in target.entries), default=0)

    def read(name: str) -> torch.Tensor:
        tensor = model.read(name)
        report.tensors += 1
        report.nbytes += tensor.numel() * tensor.element_size()
        return tensor

    try:
        report.files = model_writer.write_model(storage, out_tag, target, read, xser=desc.xser, progress=progress)
        carried = _carry_top_level(ckpt, out_tag_dir)
        offline_tag.commit(storage, _model_metadata(ckpt, desc, out_tag, target, carried))
    except BaseException:
        shutil.rmtree(out_tag_dir, ignore_errors=True)  # never complete: 'done' comes last
        raise


def _model_metadata(
    ckpt: Checkpoint, desc: Any, out_tag: str, target: model_writer.ModelPlan, carried: list[str]
) -> TagMetadata:
    """The re-sharded tag's nxd_ckpt.json: the source's (a fresh one for NxD-written tags) with the new layout,
    its sharding record, and no optimizer."""
    items = tuple(i for i in ("model", *carried) if i in desc.saved_items or i == "model")
    return offline_tag.output_metadata(
        desc.metadata,
        out_tag,
        tp=target.tp,
        pp=target.pp,
        dp=None,
        cp=None,
        zero1=False,
        zero1_dp_size=None,
        zero1_full=None,
        xser=desc.xser,
        items=items,
        converted_from={"tag": ckpt.tag, "dp": desc.dp, "tp": desc.tp, "pp": desc.pp},
        sharding=target.record,
    )


def _carry_top_level(ckpt: Checkpoint, out_tag_dir: str) -> list[str]:
    """Copy the scheduler and user content files (checked against the manifest); return the items copied."""
    storage = VerifyOnceStorage(ckpt.storage, ckpt.tag)
    carried = []
    for item, name in (("scheduler", layout.SCHEDULER_FILE), ("user_content", layout.USER_CONTENT_FILE)):
        path = layout.tag_path(ckpt.tag, name)
        if not storage.exists(path):
            continue
        with (
            storage.open_read(path) as src,
            atomic_file(os.path.join(out_tag_dir, name)) as tmp,
            open(tmp, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 8 << 20)
        carried.append(item)
    return carried


def _reshard_dp(
    ckpt: Checkpoint,
    desc: object,
    out_root: str,
    out_tag: str,
    dp: int | None,
    model_only: bool,
    num_workers: int,
    src: tuple[int | None, int, int],
    start: float,
) -> ReshardReport:
    """TP and PP unchanged: the ZeRO-1 converter for the DP change (model files are DP-independent)."""
    from nxd_ckpt.tools.convert_zero1 import convert_zero1

    tp, pp = src[1], src[2]
    zero1 = bool(getattr(desc, "zero1", False))
    out_tag_dir = os.path.join(out_root, out_tag)
    in_tag_dir = os.path.join(ckpt.storage.local_path(""), ckpt.tag)
    if model_only:
        raise ReshardError(
            f"--model-only goes with a TP or PP change; {ckpt.url} is already TP={tp} PP={pp} (for the model alone "
            "at any DP, load it with optimizer=None: model files do not depend on DP)"
        )
    if dp is None or (dp == src[0] and not getattr(desc, "zero1_full", False)):
        raise ReshardError(f"{ckpt.url} is already DP={src[0]} TP={tp} PP={pp}; give a different --tp, --pp or --dp")
    if not zero1:
        raise ReshardError(
            f"{ckpt.url} has no ZeRO-1 optimizer shards, so nothing in it depends on DP: load it at DP={dp} as it is"
        )
    report = convert_zero1(in_tag_dir, out_tag_dir, dp_size=dp, convert_to_sharded=True, num_workers=num_workers)
    out = ReshardReport(ckpt.url, out_tag_dir, src, (dp, tp, pp))
    out.files = report.files_written
    out.nbytes = report.bytes_converted
    out.seconds = time.perf_counter() - start
    return out


def _reshard_zero1_dcp(
    ckpt: Checkpoint,
    desc: Any,
    out_root: str,
    out_tag: str,
    dp: int | None,
    param_order: Mapping[int, Sequence[str]] | None,
    src: tuple[int | None, int, int],
    start: float,
) -> ReshardReport:
    """NxD's ZeRO-1-through-DCP optimizer state as NxD's per-rank ZeRO-1 files for DP ``dp`` (same TP, PP)."""
    from nxd_ckpt.tools import zero1_dcp

    in_tag_dir = os.path.join(ckpt.storage.local_path(""), ckpt.tag)
    if dp is None:
        raise ReshardError(
            f"{ckpt.url} holds ZeRO-1 state in DCP format (use_zero1_dcp=True); give --dp K to write it as NxD's "
            "per-rank ZeRO-1 files for DP=K"
        )
    if not param_order:
        raise ReshardError(
            f"{ckpt.url}: DCP's files name the optimizer state by parameter name, NxD's ZeRO-1 files by the "
            'optimizer\'s parameter index; give the order (--param-order FILE: JSON {"0": [names of PP stage 0 in '
            "optimizer order], ...}, or param_order=zero1_dcp.param_order_of(model, optimizer) per stage)"
        )
    src_optim = zero1_dcp.NxdZero1Dcp(in_tag_dir, allow_pickle=ckpt.allow_pickle)
    if (src_optim.tp, src_optim.pp) != (src[1], src[2]):
        raise ReshardError(
            f"{ckpt.url}: the DCP optimizer state is for TP={src_optim.tp} PP={src_optim.pp}, the model files for "
            f"TP={src[1]} PP={src[2]}"
        )
    out_tag_dir = os.path.join(out_root, out_tag)
    storage = offline_tag.begin(out_root, out_tag, overwrite_hint="")
    report = ReshardReport(ckpt.url, out_tag_dir, (None, src[1], src[2]), (dp, src[1], src[2]))
    try:
        offline_tag.carry_over(in_tag_dir, out_tag_dir, skip_dirs=(layout.OPTIM_DIR,))
        report.files, report.nbytes = zero1_dcp.convert(src_optim, storage, out_tag, dp, param_order, xser=desc.xser)
        meta = offline_tag.output_metadata(
            desc.metadata,
            out_tag,
            tp=src[1],
            pp=src[2],
            **offline_tag.zero1_layout(dp),
            xser=desc.xser,
            items=tuple(dict.fromkeys((*desc.present_items, "optimizer"))),
            converted_from={"tag": ckpt.tag, "format": "zero1_dcp"},
        )
        offline_tag.commit(storage, meta)
    except BaseException:
        shutil.rmtree(out_tag_dir, ignore_errors=True)  # never complete: 'done' comes last
        raise
    report.seconds = time.perf_counter() - start
    return report
