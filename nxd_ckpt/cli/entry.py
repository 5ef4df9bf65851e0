"""The ``nxd-ckpt`` entry point: parse the command line, run the subcommand, turn its outcome into an exit status."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from nxd_ckpt.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PROG, print_err
from nxd_ckpt.cli.parser import build_parser
from nxd_ckpt.errors import CheckpointError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=f"{PROG}: %(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. piped into head: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return EXIT_OK
    except KeyError as e:  # an object path that is not in the checkpoint
        print_err(f"error: {e.args[0] if e.args else e}")
        return EXIT_FAILED
    except (CheckpointError, OSError, ValueError) as e:
        print_err(f"error: {e}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        print_err("interrupted")
        return 130
