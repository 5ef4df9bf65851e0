"""The commands that write another layout of a checkpoint: ``export``, ``import``, ``reshard`` and
``convert-zero1`` (each a thin shell over its tool in nxd_ckpt.tools), and the files they read (renames, sharding
spec, stage map, parameter order)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from nxd_ckpt.cli.locate import open_tag
from nxd_ckpt.cli.output import EXIT_OK, PROG, print_err
from nxd_ckpt.cli.progress import progress_bar
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.tools import zero1_cli
from nxd_ckpt.tools.user_files import read_json_object

# Imported on first use: `--help` and usage errors never import torch (2-3 s); see tests/cli.
export = lazy_module("nxd_ckpt.tools.export")
model_source = lazy_module("nxd_ckpt.tools.model_source")
safetensors_io = lazy_module("nxd_ckpt.tools.safetensors_io")
model_writer = lazy_module("nxd_ckpt.tools.model_writer")
reshard = lazy_module("nxd_ckpt.tools.reshard")
importer = lazy_module("nxd_ckpt.tools.importer")
tool_memory = lazy_module("nxd_ckpt.tools.malloc_tuning")


def _rename_map(args: argparse.Namespace) -> Any:
    """The renames of ``--rename FILE`` then ``--rename-pattern``s, as one ``export.RenameMap``."""
    rename = export.RenameMap()
    if getattr(args, "rename", None):
        rename = rename.then(export.RenameMap.from_file(args.rename))
    if getattr(args, "rename_pattern", None):
        rename = rename.then(export.RenameMap.from_pairs(args.rename_pattern))
    return rename


def _sharding_spec(args: argparse.Namespace) -> Any:
    """The ``--sharding-spec`` file read, or None."""
    return model_source.read_sharding_spec(args.sharding_spec) if getattr(args, "sharding_spec", None) else None


def cmd_export(args: argparse.Namespace) -> int:
    """``export``: the model state merged into safetensors (a set or one file) or DCP, or one state file as saved."""
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/malloc_tuning.py
    if os.path.lexists(args.out) and not args.force:
        raise CheckpointError(f"{args.out} already exists; pass --force to overwrite it")
    if args.shard and (args.format != "safetensors" or not args.out.endswith(".safetensors")):
        raise ValueError("--shard writes one state file as one .safetensors file: give --out FILE.safetensors")
    rename, spec = _rename_map(args), _sharding_spec(args)
    max_shard = safetensors_io.parse_size(args.max_shard_size)
    ckpt = open_tag(args)
    total = sum(o.nbytes for o in ckpt.objects() if o.kind == "tensor" and o.path.startswith("model/"))
    bar = progress_bar(total, f"export {ckpt.tag}", args.progress)
    try:
        if args.shard:
            report = export.export_state_file(ckpt, args.shard, args.out, progress=bar.update)
        else:
            report = export.export(
                ckpt,
                args.out,
                format=args.format,
                sharding=spec,
                rename=rename,
                max_shard_bytes=max_shard,
                overwrite=args.force,
                progress=bar.update,
            )
    finally:
        bar.close()
    if report.skipped:
        print_err(
            f"skipped {len(report.skipped)} values ({report.format} export holds tensors only; an optimum-neuron "
            "tag's consolidation keeps its parameters only): "
            + ", ".join(report.skipped[:5])
            + (" ..." if len(report.skipped) > 5 else "")
        )
    files = f" in {len(report.files)} files" if len(report.files) > 1 else ""
    print(f"wrote {report.out}: {report.tensors} tensors, {format_bytes(report.nbytes)}{files} from {ckpt.url}")
    return EXIT_OK


def _stage_map(args: argparse.Namespace) -> Any:
    """The ``--stage-map`` file (name pattern -> PP stage) read and checked, or None."""
    if not getattr(args, "stage_map", None):
        return None
    expected = 'a JSON object of name pattern -> PP stage, e.g. {"*": 0}'
    doc = read_json_object(args.stage_map, "stage map", expected)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in doc.values()):
        raise ValueError(f"stage map {args.stage_map} must be {expected}")
    return model_writer.stage_map(doc)


def _param_order(args: argparse.Namespace) -> Any:
    """The ``--param-order`` file (PP stage -> parameter names in the optimizer's order) read and checked, or None."""
    if not getattr(args, "param_order", None):
        return None
    expected = 'JSON {"PP stage": [names], ...}'
    doc = read_json_object(args.param_order, "parameter order", expected)
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in doc.values()):
        raise ValueError(f"parameter order {args.param_order} must be {expected}")
    try:
        return {int(k): v for k, v in doc.items()}
    except ValueError as e:
        raise ValueError(f"parameter order {args.param_order}: keys must be PP stage numbers ({e})") from e


def cmd_reshard(args: argparse.Namespace) -> int:
    """``reshard``: the tag written for another TP/PP/DP layout as a new tag."""
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/malloc_tuning.py
    if args.tp is None and args.pp is None and args.dp is None:
        raise ValueError("give the target layout: --tp, --pp and/or --dp")
    spec, stage_of = _sharding_spec(args), _stage_map(args)
    ckpt = open_tag(args)
    bar = progress_bar(0, f"reshard {ckpt.tag}", args.progress)
    try:
        report = reshard.reshard(
            ckpt,
            args.out,
            args.out_tag,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            sharding=spec,
            stage_of=stage_of,
            model_only=args.model_only,
            num_workers=args.num_workers,
            param_order=_param_order(args),
            progress=bar.update,
        )
    finally:
        bar.close()
    print(report.summary())
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """``import``: whole-model weights (safetensors or DCP) written as an NxD-layout tag."""
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/malloc_tuning.py
    spec, stage_of = _sharding_spec(args), _stage_map(args)
    report = importer.import_weights(
        args.source,
        args.out,
        args.tag,
        tp=args.tp,
        pp=args.pp,
        sharding=spec,
        stage_of=stage_of,
        format=args.format,
        rename=_rename_map(args),
        use_xser=args.xser,
        allow_pickle=args.allow_pickle,
    )
    print(report.summary())
    return EXIT_OK


def cmd_convert_zero1(args: argparse.Namespace) -> int:
    """The ZeRO-1 converter (nxd_ckpt.tools.convert_zero1) with the checkpoint directory + --tag, like the others."""
    return zero1_cli.run(args, prog=f"{PROG} convert-zero1")
