"""Deadlines of the cross-rank steps, from one setting: each step's (``NXD_CKPT_TIMEOUT_S`` or a call's
``timeout=``), and what follows from it: when a storage call counts as stalled, how often a wait is logged."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from nxd_ckpt.errors import CheckpointTimeoutError

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


@dataclass(frozen=True)
class Deadline:
    """How long each wait of one save's background work may last (the save's ``timeout_s``) and whose waits they
    are (``rank``, named in the error): a stuck device transfer or an earlier save that never ends raises
    ``CheckpointTimeoutError`` instead of hanging the rank."""

    timeout_s: float
    rank: int | None = None

    @classmethod
    def default(cls) -> Deadline:
        """The library's deadline (``default_timeout_s``), for waits whose save did not give one."""
        return cls(default_timeout_s())

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], phase: str, waited_for: str) -> None:
        """(``cond`` held.) Wait until ``ready()``; past the deadline raise ``expired``."""
        if not cond.wait_for(ready, self.timeout_s):
            raise self.expired(phase, waited_for)

    def expired(self, phase: str, waited_for: str) -> CheckpointTimeoutError:
        """The error of a wait in ``phase`` for ``waited_for`` that passed the deadline."""
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return CheckpointTimeoutError(
            f"{phase}{where}: waited {self.timeout_s:g} s for {waited_for}, past the save's deadline "
            f"(timeout= or {TIMEOUT_ENV}); the device or storage is stuck or far too slow. The previous complete "
            "checkpoint stays the latest; check the device and storage, or raise the timeout",
            phase=phase,
        )
