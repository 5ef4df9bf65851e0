"""What a command shows: results on stdout (tables, JSON; sizes by ``log.format_bytes``), diagnostics on stderr, and
its exit status."""

from __future__ import annotations

import json
import sys
from typing import Any

PROG = "nxd-ckpt"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def print_table(rows: list[list[str]]) -> None:
    """Rows of cells as left-aligned columns on stdout."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def print_json(obj: Any) -> None:
    """``--json`` output: one indented JSON document on stdout (what JSON cannot hold as its ``str``)."""
    json.dump(obj, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def print_err(message: str) -> None:
    """A diagnostic on stderr, prefixed with the program's name."""
    print(f"{PROG}: {message}", file=sys.stderr)
