"""How a subcommand's arguments are declared: ``Arg`` (one argument), ``Command`` (a subcommand and its arguments),
the global options and the arguments several subcommands share (``SHARED_ARGS``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def positive_int(text: str) -> int:
    """argparse type of the sizes and counts: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class Arg:
    """One command-line argument, declared once: argparse's ``add_argument(*flags, **options)``."""

    flags: tuple[str, ...]
    options: dict[str, Any]

    def add_to(self, parser: argparse.ArgumentParser, command: str = "", **overrides: Any) -> None:
        """Add it to ``parser``; ``{command}`` in the help names the subcommand."""
        options = {**self.options, **overrides}
        if isinstance(options.get("help"), str):
            options["help"] = options["help"].replace("{command}", command)
        parser.add_argument(*self.flags, **options)

    @classmethod
    def of(cls, *flags: str, **options: Any) -> Arg:
        """An Arg, spelled as ``add_argument``'s call."""
        return cls(flags, options)


SHARDING_JSON = (
    'JSON of name pattern -> partition dim, [dim, stride] or null (replicated), e.g. {"*.qkv_proj.weight": [0, 3], '
    '"*": null}'
)

GLOBAL_ARGS = (
    Arg.of("-v", "--verbose", action="store_true", help="log what nxd_ckpt does (to stderr)"),
    Arg.of(
        "--no-progress", dest="progress", action="store_false", help="no progress bars (they only show on a terminal)"
    ),
)
"""The main parser's options; accepted after the subcommand too (hidden there, defaults stay the main parser's)."""

SHARED_ARGS = {
    "dir": Arg.of(
        "dir", metavar="DIR", help="checkpoint directory (the one holding the tag directories) or s3://bucket/prefix"
    ),
    "tag": Arg.of("--tag", help="tag to {command} (default: the latest complete one)"),
    "json": Arg.of("--json", action="store_true", help="machine-readable output"),
    "allow-pickle": Arg.of(
        "--allow-pickle", action="store_true", help="unpickle arbitrary classes (trusted checkpoints only)"
    ),
    "rename": Arg.of(
        "--rename", metavar="FILE", help='JSON rename map: {"old": "new"} or {"exact": {...}, "patterns": [[re, repl]]}'
    ),
    "rename-pattern": Arg.of(
        "--rename-pattern",
        action="append",
        metavar="REGEX=REPL",
        help="rename names matching REGEX (re.sub replacement; repeatable, first match wins)",
    ),
    "sharding-spec": Arg.of(
        "--sharding-spec",
        metavar="FILE",
        help="how tensors are split over TP ranks when no record says so: " + SHARDING_JSON,
    ),
    "stage-map": Arg.of(
        "--stage-map",
        metavar="FILE",
        help='for a PP change: JSON of name pattern -> target PP stage, e.g. {"layers.[0-3].*": 0, "*": 1}',
    ),
}
"""The arguments several subcommands take, by name: a command lists the names it takes (``COMMANDS``)."""


def shared_arg(name: str, **overrides: Any) -> Arg:
    """A shared argument with this command's own wording (``help=``) or settings."""
    shared = SHARED_ARGS[name]
    return Arg(shared.flags, {**shared.options, **overrides})


CommandArg = str | Arg | Callable[[argparse.ArgumentParser], Any]
"""A name in SHARED_ARGS, an argument of one command, or a function adding a group of them (the converter's)."""


@dataclass(frozen=True)
class Command:
    """One subcommand: the function running it, its help (also its description), its arguments in --help order."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    arguments: tuple[CommandArg, ...]

    def add_to(self, subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
        """Its subparser, with its arguments."""
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help, parents=parents)
        parser.set_defaults(func=self.run)
        for argument in self.arguments:
            if isinstance(argument, str):
                SHARED_ARGS[argument].add_to(parser, self.name)
            elif isinstance(argument, Arg):
                argument.add_to(parser, self.name)
            else:
                argument(parser)
