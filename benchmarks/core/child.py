"""A function of a suite run in a fresh process (a first save is a one-time cost per process; a tool's peak
memory is its own process's): ``in_child("benchmarks.suites.x:fn", kwargs)`` runs
``python -m benchmarks.core.child`` and returns the function's JSON result.

This module imports nothing of nxd_ckpt, so a child's first import of it happens inside the function.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_child(
    target: str, kwargs: dict[str, Any], env: dict[str, str] | None = None, path_first: str | None = None,
    timeout: float = 3600.0, quiet: bool = False, python: str | None = None,
) -> Any:  # fmt: skip
    """Run ``target`` (``module:function``) with ``kwargs`` in a fresh Python process and return its result.
    ``path_first`` goes before this repository on the child's PYTHONPATH (another tree's nxd_ckpt); ``quiet``
    keeps the child's own output off the terminal; ``python`` is the child's interpreter (default this one: another
    environment's, such as the XLA one). A failed child raises with its exit code and output's end."""
    paths = [p for p in (path_first, REPO, os.environ.get("PYTHONPATH")) if p]
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    with tempfile.TemporaryDirectory(prefix="nxd_bench_child_") as scratch:
        out = os.path.join(scratch, "result.json")
        command = [python or sys.executable, "-m", "benchmarks.core.child", target, json.dumps(kwargs), out]
        # cwd: not this repository, whose nxd_ckpt would come first on the path of ``python -m``
        done = subprocess.run(command, env=child_env, cwd=scratch, timeout=timeout, check=False,
                              capture_output=quiet, text=True)  # fmt: skip
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or "")[-2000:] if quiet else "(its output is above)"
            raise RuntimeError(f"the child process running {target} failed (exit {done.returncode}): {tail}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str]) -> int:
    """The child's side: import the target, call it with the JSON keyword arguments, write its result."""
    target, kwargs, out = argv
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(**json.loads(kwargs))
    with open(out, "w") as f:
        json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
