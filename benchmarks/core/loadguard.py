"""The load-average guard: figures taken while other work runs on the machine are not results, so a suite refuses
to start above a 1-minute load average of 1, unless told to run anyway (then it warns loudly and the report says
so)."""

from __future__ import annotations

import os
import sys

LIMIT = 1.0
"""The highest 1-minute load average at which a suite starts."""


class MachineBusy(SystemExit):
    """The machine is too busy for figures to mean anything: the suite did not start."""


def check_load(override: bool, limit: float = LIMIT) -> dict[str, float | bool]:
    """The load average now, checked against ``limit``: raise ``MachineBusy`` above it, or with ``override`` warn
    on stderr. Returns what the report records (``load_start``, ``load_override``)."""
    load = os.getloadavg()[0]
    busy = load > limit
    if busy and not override:
        raise MachineBusy(
            f"benchmarks: the 1-minute load average is {load:.2f}, above {limit:g}: figures taken while other work "
            "runs are not results. Wait until the machine is quiet (`uptime`), or pass --ignore-load to run anyway "
            "(a smoke run; the report then says the figures were taken under load)."
        )
    if busy:
        bar = "!" * 100
        print(f"{bar}\nWARNING: load average {load:.2f} > {limit:g} (--ignore-load): these figures are taken under "
              f"load and are NOT results\n{bar}", file=sys.stderr, flush=True)  # fmt: skip
    return {"load_start": load, "load_override": busy}
