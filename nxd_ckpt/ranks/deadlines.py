"""Deadlines of the cross-rank steps, from one setting: each step's (``NXD_CKPT_TIMEOUT_S`` or a call's
``timeout=``), and what follows from it: when a storage call counts as stalled, how often a wait is logged."""

from __future__ import annotations

TIMEOUT_ENV = "NXD_CKPT_TIMEOUT_S"
MAX_STALL_S = 300.0
"""A storage call with no progress for min(deadline / 2, this) is a stall (see ``watchdog.py``)."""


def default_timeout_s() -> float:
    """The deadline of every phase: ``NXD_CKPT_TIMEOUT_S`` (or the older ``NXD_CKPT_COMMIT_TIMEOUT_S``), default
    1800 s (``knobs.timeout_s``)."""
    from nxd_ckpt import knobs

    return knobs.timeout_s()


def resolve_timeout(timeout: float | None) -> float:
    """The deadline for one call: its ``timeout=`` if given, else ``default_timeout_s()``."""
    if timeout is None:
        return default_timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None for {TIMEOUT_ENV}), got {timeout!r}")
    return float(timeout)


def stall_limit_s(timeout_s: float) -> float:
    """Seconds without storage progress that count as a stall: half the deadline (so a call that stopped moving
    is told apart from one that only crawls), at most 5 minutes."""
    return min(timeout_s / 2, MAX_STALL_S)


def log_interval_s(timeout_s: float) -> float:
    """How often the master repeats "waiting for ranks ...": four times per deadline, at most every 30 s."""
    return min(30.0, max(0.25, timeout_s / 4))
