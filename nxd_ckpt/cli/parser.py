"""The ``nxd-ckpt`` parser: every subcommand (``COMMANDS``: its function, help and arguments) and
``build_parser``."""

from __future__ import annotations

import argparse

from nxd_ckpt import __version__
from nxd_ckpt.cli.arguments import GLOBAL_ARGS, SHARDING_JSON, Arg, Command, positive_int, shared_arg
from nxd_ckpt.cli.inspect_command import cmd_inspect
from nxd_ckpt.cli.layout_commands import cmd_convert_zero1, cmd_export, cmd_import, cmd_reshard
from nxd_ckpt.cli.output import PROG
from nxd_ckpt.cli.tag_commands import cmd_list, cmd_prune, cmd_verify
from nxd_ckpt.tools import zero1_cli

DIR_OR_FOLDER = shared_arg(
    "dir",
    help="checkpoint directory (the one holding the tag or step-N directories) or s3://bucket/prefix; or one DCP "
    "checkpoint folder (dcp.load's checkpoint_id) or Hugging Face safetensors folder itself",
)
"""DIR of ``list``, ``inspect`` and ``verify``, which also take one checkpoint folder (``locate.locate``)."""

COMMANDS = (
    Command(
        "list",
        cmd_list,
        "list the tags of a checkpoint directory, oldest first: complete or not, latest, size, layout",
        (DIR_OR_FOLDER, "json"),
    ),
    Command(
        "inspect",
        cmd_inspect,
        "show a checkpoint's state files and, per file, every tensor's shape, dtype and bytes, without loading "
        "tensor data",
        (
            DIR_OR_FOLDER,
            "tag",
            "json",
            Arg.of("--files", action="store_true", help="list every file (default: one line per xser .tensors dir)"),
            Arg.of("--object", metavar="PATH", help="print one object, e.g. model/tp00_pp00/fc1.weight"),
            Arg.of(
                "--metadata",
                action="store_true",
                help="layout, nxd_ckpt.json and files only (no state file is opened)",
            ),
            "allow-pickle",
        ),
    ),
    Command(
        "verify",
        cmd_verify,
        "check a checkpoint: done marker, every state file the layout needs, readable files, CRC-32s and recorded "
        "checksums (a DCP or Hugging Face folder: its manifests' checksums, else what its format allows, and it says "
        "which); exit status 1 if anything is wrong",
        (
            DIR_OR_FOLDER,
            "tag",
            Arg.of("--all", action="store_true", help="verify every complete tag"),
            Arg.of("--quick", action="store_true", help="check structure only, without reading tensor data"),
            "json",
        ),
    ),
    Command(
        "convert-zero1",
        cmd_convert_zero1,
        "convert a tag's ZeRO-1 optimizer state between sharded and full, or to a new DP size; writes a complete, "
        "verified tag ('done' last). NxD's flags (--input_dir TAG_FOLDER --output_dir TAG_FOLDER --convert_to_full "
        "...) are accepted too",
        (zero1_cli.add_arguments,),
    ),
    Command(
        "prune",
        cmd_prune,
        "delete all but the newest N complete checkpoints (and incomplete ones older than those), 'done' first so a "
        "crash never leaves a tag that looks complete",
        (
            "dir",
            Arg.of("--keep", type=positive_int, required=True, metavar="N", help="complete checkpoints to keep"),
            Arg.of("--dry-run", action="store_true", help="only print what would be deleted"),
        ),
    ),
    Command(
        "export",
        cmd_export,
        "write a checkpoint's model state (any TP/PP layout: shards merged, stages joined) as one Hugging Face-style "
        "safetensors set, one .safetensors file, or a torch Distributed Checkpoint (--format dcp)",
        (
            "dir",
            "tag",
            Arg.of(
                "--out",
                required=True,
                metavar="PATH",
                help="directory to create (safetensors set: model-0000i-of-0000N.safetensors + "
                "model.safetensors.index.json; or a DCP checkpoint), or FILE.safetensors for one file",
            ),
            Arg.of("--format", choices=("safetensors", "dcp"), default="safetensors", help="default: safetensors"),
            Arg.of(
                "--max-shard-size",
                default="5GB",
                metavar="SIZE",
                help="largest file of a safetensors set (default 5GB)",
            ),
            "rename",
            "rename-pattern",
            shared_arg(
                "sharding-spec",
                help="for tags saved at TP>1 without a sharding record (NxD-written): " + SHARDING_JSON,
            ),
            Arg.of("--shard", metavar="PREFIX", help="export one state file as saved instead, e.g. model/tp01_pp00"),
            Arg.of("--force", action="store_true", help="replace PATH if it exists (once the new one is complete)"),
            "allow-pickle",
        ),
    ),
    Command(
        "reshard",
        cmd_reshard,
        "write a tag re-sharded for another TP/PP/DP layout as a new, verified tag ('done' last). A DP-only change "
        "re-cuts ZeRO-1 optimizer shards (as convert-zero1); a TP/PP change streams the model one tensor at a time "
        "(--model-only: the optimizer state is not carried; load_checkpoint re-shards it online)",
        (
            "dir",
            "tag",
            Arg.of("--tp", type=positive_int, metavar="N", help="target tensor-parallel size (default: the tag's)"),
            Arg.of("--pp", type=positive_int, metavar="M", help="target pipeline-parallel size (default: the tag's)"),
            Arg.of("--dp", type=positive_int, metavar="K", help="target data-parallel size (ZeRO-1 shards)"),
            Arg.of("--out", required=True, metavar="OUT", help="checkpoint directory to write the new tag into"),
            Arg.of("--out-tag", metavar="TAG", help="tag name to write (default: the input's); must not exist"),
            Arg.of("--model-only", action="store_true", help="TP/PP change: drop the optimizer state"),
            Arg.of(
                "--param-order",
                metavar="FILE",
                help='ZeRO-1 state NxD saved through DCP (use_zero1_dcp=True): JSON {"PP stage": [parameter names in '
                "the optimizer's order]}, to write it as NxD's per-rank ZeRO-1 files for --dp",
            ),
            Arg.of(
                "--num-workers", type=positive_int, default=1, metavar="N", help="DP change: coordinates in parallel"
            ),
            "sharding-spec",
            "stage-map",
            "allow-pickle",
        ),
    ),
    Command(
        "import",
        cmd_import,
        "write whole-model weights (a safetensors file or set, or a DCP checkpoint) as an NxD-layout tag for a TP/PP "
        "layout (model only; loads at any DP), verified, 'done' last",
        (
            Arg.of("source", metavar="SOURCE", help="a .safetensors file, a safetensors set directory or a DCP dir"),
            Arg.of("--out", required=True, metavar="DIR", help="checkpoint directory to write the tag into"),
            Arg.of("--tag", required=True, help="tag name to write (must not exist)"),
            Arg.of("--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel size (default 1)"),
            Arg.of("--pp", type=positive_int, default=1, metavar="M", help="pipeline-parallel size (default 1)"),
            Arg.of("--format", choices=("safetensors", "dcp"), help="default: detected from SOURCE"),
            Arg.of("--xser", action="store_true", help="write xser model files (one file per tensor)"),
            shared_arg("rename", help="JSON rename map applied to the source's names first"),
            shared_arg("rename-pattern", help="rename by pattern (repeatable)"),
            "sharding-spec",
            "stage-map",
            shared_arg("allow-pickle", help="DCP: unpickle .metadata without restrictions (trusted only)"),
        ),
    ),
)
"""Every subcommand, in --help order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``nxd-ckpt`` parser: the global options, then one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look into, check, prune and export nxd_ckpt / NeuronX Distributed checkpoints. "
        "DIR is a checkpoint directory (the one holding the tag directories) or s3://bucket/prefix.",
        epilog="Exit status: 0 success, 1 failure (or problems found), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    hidden_globals = argparse.ArgumentParser(add_help=False)
    for arg in GLOBAL_ARGS:
        arg.add_to(parser)
        arg.add_to(hidden_globals, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in COMMANDS:
        command.add_to(subparsers, parents=[hidden_globals])
    return parser
