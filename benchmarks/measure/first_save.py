"""The first async save of a process against the later ones: one measurement, used by the suites that report it
(``first_save`` in fresh processes, ``saveload``'s first async save on its ranks, ``device``'s first saves and
``async``'s first save).

``probe`` times one save call as a training loop makes it (attribute access included) and counts what it did:
the page faults the process took in the call (fresh memory costs one per 4 KiB page), the modules it imported,
and the report's staging figures. ``first_vs_steady`` is the target's ratio: the first save's blocked time over
the median of the later ones (target <= 1.5)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.core.memory import minor_faults

TARGET = 1.5
"""The first async save blocks at most this many times a steady one."""


def probe(call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run the save ``call`` and return (its report, figures): ``blocked_s`` (the call's wall time),
    ``faults`` and ``imported_modules`` in the call, and the report's ``staging_s`` and staging allocation."""
    faults, modules = minor_faults(), set(sys.modules)
    start = time.perf_counter()
    report = call()
    blocked = time.perf_counter() - start
    figures = {
        "blocked_s": blocked,
        "faults": minor_faults() - faults,
        "imported_modules": len(set(sys.modules) - modules),
        "staging_s": getattr(report, "staging_s", None),
        "allocated_mib": getattr(report, "staging_allocated_bytes", 0) / 2**20,
    }
    return report, figures


def first_vs_steady(blocked: Sequence[float]) -> dict[str, float]:
    """The first of ``blocked`` (seconds), the median of the later ones, and their ratio."""
    if len(blocked) < 2:
        raise ValueError(f"a first and a steady save are needed: got {len(blocked)} save(s); make at least 2")
    first, steady = blocked[0], statistics.median(blocked[1:])
    return {"first_s": first, "steady_s": steady, "ratio": first / steady}


def training_step(x: Any, w: Any) -> float:
    """A stand-in for one training step's host work (fixed matmuls); returns its seconds."""
    import torch

    start = time.perf_counter()
    for _ in range(4):
        x = torch.tanh(x @ w)
    return time.perf_counter() - start


def prepare_beside_training(model: Any, optimizer: Any) -> dict[str, Any]:
    """``prepare_async_save`` once the state exists, then stand-in training steps while its buffers are faulted
    in beside them: the call's time, the fault-in's, each step's during and after (against steps before)."""
    import torch

    import nxd_ckpt as nxd

    x, w = torch.randn(256, 1024), torch.randn(1024, 1024) / 32
    baseline = [training_step(x, w) for _ in range(5)]
    start = time.perf_counter()
    nxd.prepare_async_save(model=model, optimizer=optimizer)
    prepare_call_s = time.perf_counter() - start
    pool = nxd.get_manager()._staging_pool
    during: list[float] = []
    while not pool.wait_prepared(timeout=0):
        during.append(training_step(x, w))
    faulted_s = time.perf_counter() - start
    after = [training_step(x, w) for _ in range(5)]
    return {
        "prepare_call_s": prepare_call_s,
        "prepare_faulted_s": faulted_s,
        "step_during_prepare_s": statistics.median(during) if during else float("nan"),
        "steps_during_prepare": len(during),
        "step_after_prepare_s": statistics.median(after + baseline),
    }


def ratio_line(first: float, steady: float, what: str = "first async save of the process") -> str:
    """The target's line: first / steady blocked time, and whether it is met."""
    ratio = first / steady
    verdict = "MET" if ratio <= TARGET else "NOT MET"
    return f"{what} blocks {first:.3f} s, the next ones {steady:.3f} s: {ratio:.2f}x (target <= {TARGET}): {verdict}"
