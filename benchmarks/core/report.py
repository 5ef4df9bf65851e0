"""One report format for every suite: markdown lines printed as they are measured, figures for JSON, and both
written at the end (``--json`` / ``--markdown``), with the command, the load average and the versions."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def fmt_bytes(n: float | None) -> str:
    """Decimal bytes at a readable scale (``n/a`` for a missing figure)."""
    if n is None:
        return "n/a"
    if abs(n) >= 1e8:
        return f"{n / 1e9:.3f} GB"
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e5 else f"{n / 1e3:.1f} kB"


def verdict(ok: bool) -> str:
    """How a target line ends."""
    return "MET" if ok else "NOT MET"


class Report:
    """A suite's output: ``say`` prints a markdown line at once (a long run stopped part-way keeps what it
    printed) and keeps it; ``data`` holds the figures the JSON gets; ``finish`` writes both."""

    def __init__(self, suite: str, argv: Sequence[str] | None = None) -> None:
        self.suite = suite
        self.command = [os.path.basename(sys.executable), "-m", "benchmarks", *(argv or sys.argv[1:])]
        self.meta: dict[str, Any] = {}
        self.data: dict[str, Any] = {}
        self.lines: list[str] = []

    def say(self, line: str = "", err: bool = False) -> None:
        """Print ``line`` now (stderr for progress notes, which the markdown leaves out) and keep it."""
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
        if not err:
            self.lines.append(line)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] = ()) -> None:
        """A markdown table: ``align`` per column, ``l`` or ``r`` (default: the first left, the others right)."""
        marks = [("---" if (align[i] if i < len(align) else ("l" if i == 0 else "r")) == "l" else "---:")
                 for i in range(len(headers))]  # fmt: skip
        self.say("| " + " | ".join(headers) + " |")
        self.say("|" + "|".join(marks) + "|")
        for row in rows:
            self.say("| " + " | ".join(str(cell) for cell in row) + " |")

    def markdown(self) -> str:
        """The report as markdown: the command first, then every line said."""
        return "\n".join([f"command: `{' '.join(self.command)}`", "", *self.lines]) + "\n"

    def as_json(self) -> dict[str, Any]:
        """The report as one JSON object."""
        return {"suite": self.suite, "command": self.command, "meta": self.meta, "data": self.data,
                "markdown": self.lines}  # fmt: skip

    def finish(self, json_path: str | None = None, markdown_path: str | None = None) -> None:
        """Record the load average at the end and write the JSON and markdown files asked for."""
        self.meta["load_end"] = os.getloadavg()[0]
        if json_path:
            with open(json_path, "w") as f:
                json.dump(self.as_json(), f, indent=1, default=str)
        if markdown_path:
            with open(markdown_path, "w") as f:
                f.write(self.markdown())
