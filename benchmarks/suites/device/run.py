"""The device suite's run: its options, device, training state, page cache, and every figure, error and check so
far, with the printing of each line as it is measured (``RunCore``; each block of rows adds its methods)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from typing import Any

from benchmarks.core.devices import Device, Training
from benchmarks.core.files import PageCache


def say(line: str = "") -> None:
    """Print a line now."""
    print(line, flush=True)


@dataclasses.dataclass
class RunCore:
    """What every block of the run shares; ``args.rows`` holds the rows to run."""

    args: argparse.Namespace
    dev: Device
    tr: Training
    root: str
    cache: PageCache
    results: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    checks: dict[str, str] = dataclasses.field(default_factory=dict)
    rep: int = 0
    phase: str = ""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    dcp_stager: Any = None
    dcp_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    dcp_via_host: str = ""
    """Why DCP saves get host copies of the state (its stager refused the device tensors), or ""."""
    dcp_fresh: str = ""
    """Why every DCP save gets a new DefaultStager (reusing one failed), or ""."""

    def on(self, row: str) -> bool:
        """Whether ``row`` runs."""
        return row in self.args.rows

    def where(self) -> str:
        """Where the run is (its phase or repetition, seconds since the repetitions began), for each line."""
        return f"[{self.phase or f'rep {self.rep}'}, {time.perf_counter() - self.started:.0f} s]"

    def add(self, name: str, value: Any, line: str) -> None:
        """Keep one sample of ``name`` and say its line."""
        self.results.setdefault(name, []).append(value)
        say(f"{self.where()} {line}")

    def failed(self, name: str, error: BaseException, loud: bool = False) -> None:
        """Keep ``name``'s first error and say it (``loud``: with its traceback); a failed row is never fatal."""
        text = f"{type(error).__name__}: {error}".strip()
        self.errors.setdefault(name, text)
        say(f"{self.where()} {name}: FAILED: {text.splitlines()[0]}")
        if loud:
            traceback.print_exc()
            sys.stderr.flush()

    @property
    def check(self) -> bool:
        """Whether this repetition checks the state bit for bit (the first one, unless ``check`` is left out)."""
        return self.rep == 0 and self.on("check")
