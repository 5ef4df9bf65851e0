"""Command-line front end of the ZeRO-1 converter: flags, input/output resolution, outcome. Imports no torch.

Two ways to name the input, both accepted by ``nxd-ckpt convert-zero1`` and ``scripts/convert_zero1_checkpoint.py``:

* like every other ``nxd-ckpt`` command: the checkpoint directory (the one holding the tags) and ``--tag``
  (default: the latest complete tag), written to ``--out DIR`` under the same tag name (or ``--out-tag``);
* like NxD's converter: the tag folder itself (``--input_dir ckpts/step_1200 --output_dir new/step_1200``).

A checkpoint directory passed where a tag folder is expected (or the other way round) is recognised by its
``done``/``checkpoint`` markers, or, for the markerless folders NxD's own converter writes (only ``optim/...``),
by the state files it holds (``format.tags.is_tag_folder``), so both spellings resolve to the same tag folders.
Flags use hyphens; NxD's underscore spellings (``--input_dir``, ``--dp_size``, ``--convert_to_full``, ...) are kept
as aliases.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import tags
from nxd_ckpt.storage import storage_for

SCRIPT_PROG = "convert_zero1_checkpoint.py"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The converter's flags (hyphenated, with NxD's underscore spellings as aliases): input, output, mode, run."""
    _add_input_arguments(parser)
    _add_output_arguments(parser)
    _add_mode_arguments(parser)
    _add_run_arguments(parser)
    return parser


def _nxd_spellings(flag: str) -> tuple[str, str]:
    """``flag`` (``--input-dir``) and NxD's underscore spelling of it (``--input_dir``); argparse names the value
    after the first (``input_dir``)."""
    return flag, "--" + flag[2:].replace("-", "_")


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The input: DIR and --tag like the other commands, or NxD's --input-dir naming the tag folder."""
    parser.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        help="checkpoint directory holding the tags (or s3://bucket/prefix); a tag folder is accepted too",
    )
    parser.add_argument("--tag", help="tag to convert (default: the latest complete one)")
    parser.add_argument(
        *_nxd_spellings("--input-dir"),
        metavar="PATH",
        help="NxD's spelling of DIR: the tag folder to read (e.g. ckpts/step_1200)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The output, one of two: --out (a checkpoint directory, with --out-tag) or NxD's --output-dir (a tag folder)."""
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument(
        "--out", metavar="DIR", help="checkpoint directory to write the converted tag into (same tag name)"
    )
    out.add_argument(
        *_nxd_spellings("--output-dir"),
        metavar="PATH",
        help="NxD's form: the tag folder to write (e.g. ckpts_dp2/step_1200); must not hold a checkpoint",
    )
    parser.add_argument("--out-tag", metavar="TAG", help="with --out: the tag name to write (default: the input's)")


def _add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """What to convert to, one of two: full, or shards for --dp-size."""
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--to-full",
        *_nxd_spellings("--convert-to-full"),
        dest="convert_to_full",
        action="store_true",
        help="merge the shards into optim/full_tp_rank_XX_pp_rank_YY.pt",
    )
    mode.add_argument(
        "--to-sharded",
        *_nxd_spellings("--convert-to-sharded"),
        dest="convert_to_sharded",
        action="store_true",
        help="write optim/dp_rank_.. shards for --dp-size",
    )
    parser.add_argument(*_nxd_spellings("--dp-size"), type=int, metavar="N", help="DP size of the output")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How to run: workers, overwriting, trusting pickles, the progress bar."""
    parser.add_argument(
        *_nxd_spellings("--num-workers"),
        type=int,
        default=1,
        metavar="N",
        help="(TP, PP) coordinates converted in parallel (default 1)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at the output")
    parser.add_argument(
        *_nxd_spellings("--allow-pickle"),
        action="store_true",
        help="read pickled classes (runs code from the files: trusted checkpoints only)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar (it only shows on a terminal anyway)")


def build_parser(prog: str = SCRIPT_PROG) -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(
            prog=prog,
            description="Convert the ZeRO-1 optimizer states of a checkpoint tag: to full, or to shards for a DP "
            "size. Writes a complete, verified tag; 'done' last.",
        )
    )


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}" if "://" in directory else os.path.join(directory, name)


def _is_tag_folder(path: str) -> bool:
    return tags.is_tag_folder(storage_for(path))


def resolve_paths(args: argparse.Namespace) -> tuple[str, str]:
    """(input tag folder, output tag folder) from the parsed flags; ValueError/CheckpointError say what is wrong."""
    if args.dir is not None and args.input_dir is not None:
        raise ValueError(f"give the input once: DIR ({args.dir}) or --input-dir ({args.input_dir}), not both")
    source = args.dir if args.dir is not None else args.input_dir
    if source is None:
        raise ValueError("name the input: a checkpoint directory (DIR [--tag TAG]) or a tag folder (--input-dir)")
    if "://" not in source and not os.path.isdir(source):
        raise CheckpointError(f"{source}: no such directory")
    if _is_tag_folder(source):
        if args.tag is not None:
            raise ValueError(
                f"{source} is one checkpoint (a tag folder); drop --tag, or pass the directory holding the tags"
            )
        input_tag_dir = source.rstrip("/") if "://" in source else os.path.normpath(source)
    else:
        storage = storage_for(source)
        try:
            tag = tags.resolve_tag(storage, args.tag)
        except CheckpointError as e:
            raise CheckpointError(
                f"{e} (DIR is the directory holding the tag folders; add --tag TAG, or pass a tag folder)"
            ) from e
        input_tag_dir = _join(source, tag)
    tag_name = (
        input_tag_dir.rstrip("/").rpartition("/")[2] if "://" in input_tag_dir else os.path.basename(input_tag_dir)
    )
    if args.output_dir is not None:
        if args.out_tag is not None:
            raise ValueError("--out-tag goes with --out DIR; --output-dir already names the tag folder")
        return input_tag_dir, args.output_dir
    return input_tag_dir, _join(args.out, args.out_tag or tag_name)


def run(args: argparse.Namespace, prog: str = SCRIPT_PROG) -> int:
    """Convert as the flags say; print the summary once (stdout); return 0 ok, 1 failed, 2 bad arguments."""
    try:
        input_dir, output_dir = resolve_paths(args)
    except (ValueError, CheckpointError, OSError) as e:
        return _failed(prog, e)
    from nxd_ckpt.tools.convert_zero1 import convert_zero1  # torch: only once there is something to convert

    try:
        report = convert_zero1(
            input_dir,
            output_dir,
            dp_size=args.dp_size,
            convert_to_full=args.convert_to_full,
            convert_to_sharded=args.convert_to_sharded,
            num_workers=args.num_workers,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            progress=False if args.quiet else None,
        )
    except (ValueError, CheckpointError, OSError) as e:
        return _failed(prog, e)
    print(report.summary())
    return 0


def _failed(prog: str, error: BaseException) -> int:
    """Say ``error`` on stderr; the exit status: 2 for bad arguments (a ValueError), else 1."""
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2 if isinstance(error, ValueError) else 1


def main(argv: Sequence[str] | None = None, prog: str = SCRIPT_PROG) -> int:
    """``scripts/convert_zero1_checkpoint.py``: warnings (and errors) on stderr, the summary on stdout."""
    args = build_parser(prog).parse_args(list(argv) if argv is not None else None)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=f"{prog}: %(message)s")
    return run(args, prog)
