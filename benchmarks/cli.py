"""``python -m benchmarks SUITE [--sections a,b] [options]``: the suite registry, the options every suite shares
(``--sections``, ``--list``, ``--json``, ``--markdown``, ``--ignore-load``) and the run: load guard, suite, report.

A suite is a module with ``TITLE`` (one line), ``SECTIONS`` (name -> what it measures, in run order),
``add_options(parser)`` and ``run(args, report)``; ``args.sections`` holds the sections asked for (``None``: the
suite's default). Suite modules are imported only when named, so ``--list`` needs no torch_xla.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

SUITES: dict[str, tuple[str, str]] = {
    "saveload": ("benchmarks.suites.saveload", "save/load throughput against the disk and the alternatives, "
                 "host memory, the first async save, memory-tier restores (multi-rank)"),
    "async": ("benchmarks.suites.async_save", "what an async save costs the training loop, against memcpy, "
              "a sync save and DCP's async_save (multi-rank)"),
    "dcp": ("benchmarks.suites.dcp", "DCP checkpointing on one state: stock DCP (sync, async, DefaultStager), "
            "torch_checkpointing and nxd_ckpt's DCP writer + stager; blocked, durable, loads, memory"),
    "first_save": ("benchmarks.suites.first_save", "the first async save of a process against the later ones, "
                   "each scenario in a fresh process"),
    "device": ("benchmarks.suites.device", "checkpoints of state on a device (CUDA, or XLA): floors, async and "
               "sync saves, peers, loads, memory, first saves, today's tree"),
    "memory_tier": ("benchmarks.suites.memory_tier", "memory-tier recovery from node memory, the peer and "
                    "durable storage; what the tier adds to a save's blocked time (4 ranks as 2 nodes)"),
    "scale": ("benchmarks.suites.scale", "what save, async save, load and latest cost per rank at 16 to 4,096 "
              "thread ranks (store operations, collectives, S3 requests)"),
    "coordinator": ("benchmarks.suites.coordinator", "a deadline-guarded cross-rank step against the bare "
                    "collective it wraps"),
    "reshard_reads": ("benchmarks.suites.reshard_reads", "bytes a re-sharded load reads against the bytes it "
                      "needs (TP=1 saved, TP=2 loaded)"),
    "inspect": ("benchmarks.suites.inspection", "what looking inside a checkpoint costs, against loading it"),
    "verify": ("benchmarks.suites.verify", "what checksum verification costs: hash throughput, saves and loads "
               "with and without it"),
    "s3": ("benchmarks.suites.s3", "save/load to s3:// on a loopback moto server against a raw boto3 transfer"),
    "xla_transfer": ("benchmarks.suites.xla_transfer", "XLA device->host transfers: per tensor, bulk, and on a "
                     "background thread while training runs"),
    "layout_tools_memory": ("benchmarks.suites.layout_tools_memory", "peak memory of the offline layout tools "
                            "(export, reshard, import) against the largest tensor"),
    "convert_zero1_memory": ("benchmarks.suites.convert_zero1_memory", "peak memory of the offline ZeRO-1 "
                             "converter against NxD's way (load all, merge, split)"),
}  # fmt: skip


def load_suite(name: str) -> ModuleType:
    """The suite module registered as ``name``."""
    return importlib.import_module(SUITES[name][0])


def list_suites() -> str:
    """Every suite with its one-line description."""
    width = max(map(len, SUITES))
    return "\n".join(f"{name:<{width}}  {text}" for name, (_, text) in SUITES.items())


def list_sections(suite: ModuleType) -> str:
    """A suite's sections, in run order, with what each measures."""
    width = max(map(len, suite.SECTIONS))
    return "\n".join(f"{name:<{width}}  {text}" for name, text in suite.SECTIONS.items())


def parser_for(name: str, suite: ModuleType) -> argparse.ArgumentParser:
    """The suite's argument parser: the shared options, then the suite's own."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=suite.TITLE)
    parser.add_argument("--sections", default=None, help="comma-separated sections to run (default: the suite's; "
                        "--list names them)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the suite's sections and exit")
    parser.add_argument("--json", default=None, help="write the report (every figure) as JSON here")
    parser.add_argument("--markdown", default=None, help="write the report's markdown here")
    parser.add_argument("--ignore-load", action="store_true", help="run even above a 1-minute load average of 1 "
                        "(a smoke run: the figures are not results, and the report says so)")  # fmt: skip
    suite.add_options(parser)
    return parser


def parse_sections(parser: argparse.ArgumentParser, suite: ModuleType, text: str | None) -> list[str] | None:
    """The sections asked for, checked against the suite's (an unknown one is a usage error naming the known)."""
    if text is None:
        return None
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in suite.SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(suite.SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Run the suite named first in ``argv`` (or list the suites)."""
    from benchmarks.core.loadguard import check_load
    from benchmarks.core.report import Report

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print("usage: python -m benchmarks SUITE [--sections a,b] [--list] [options]\n\nsuites:\n" + list_suites())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"benchmarks: unknown suite {name!r}; the suites are:\n{list_suites()}", file=sys.stderr)
        return 2
    suite = load_suite(name)
    parser = parser_for(name, suite)
    args = parser.parse_args(rest)
    if args.list:
        print(list_sections(suite))
        return 0
    args.sections = parse_sections(parser, suite, args.sections)
    report = Report(name, argv)
    report.meta.update(check_load(args.ignore_load))
    status = suite.run(args, report) or 0
    report.finish(args.json, args.markdown)
    return status
