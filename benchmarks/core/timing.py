"""Timers, the rotated order of interleaved repetitions, and medians that skip missing values."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values present (``None`` skipped), or ``None`` when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """``items`` started at position ``rep`` (modulo their count): repetition ``rep``'s order of interleaved
    blocks, so no block always runs first or after the same neighbour."""
    if not items:
        return []
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``'s result and its wall seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()``; its result is dropped before returning (its memory with it)."""
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def paired_median(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of per-repetition ratios: robust to the machine's drift from one repetition to the next."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def joined(values: Sequence[float | None], fmt: str = "{:.3f}") -> str:
    """``values`` as a comma-separated list (``-`` for a missing one), for a row's raw repetitions."""
    return ", ".join("-" if v is None else fmt.format(v) for v in values)
