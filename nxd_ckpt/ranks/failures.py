"""Failures across ranks: one rank's exception as a value every rank can receive (``RankFailure``) and raise
again as the same type, naming the rank it came from (``origin_rank``)."""

from __future__ import annotations

import contextlib
import importlib
import traceback
from dataclasses import dataclass, field
from typing import Any

from nxd_ckpt.errors import RemoteRankError


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    """Ranks as ``[0, 3, 5]``, for messages."""
    return "[" + ", ".join(map(str, ranks)) + "]"


@dataclass(frozen=True)
class RankFailure:
    """An exception of one rank, in a form every rank can receive and raise again as the same type."""

    rank: int
    phase: str
    module: str
    qualname: str
    message: str
    attributes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, error: BaseException, rank: int, phase: str) -> RankFailure:
        """``error`` on ``rank`` during ``phase`` (its own ``origin_rank`` wins when a step already set one)."""
        origin = getattr(error, "origin_rank", None)
        attributes = {
            k: v
            for k, v in vars(error).items()
            if k in ("phase", "missing_ranks", "path", "bytes_moved") and isinstance(v, (str, int, tuple, type(None)))
        }
        return cls(
            rank=origin if isinstance(origin, int) else rank,
            phase=phase,
            module=type(error).__module__,
            qualname=type(error).__qualname__,
            message=str(error) or type(error).__name__,
            attributes=attributes,
        )

    def describe(self) -> str:
        """One line: which rank failed, while doing what, how."""
        return f"rank {self.rank} failed while {self.phase}: {self.qualname}: {self.message}"

    def to_exception(self, also_failed: list[int] | None = None) -> BaseException:
        """An exception of the original type (a RemoteRankError if it cannot be rebuilt here), whose message
        names the rank and phase, with ``origin_rank`` set."""
        others = f" (rank(s) {ranks_text(also_failed)} failed too)" if also_failed else ""
        text = f"rank {self.rank} failed while {self.phase}: {self.message}{others}"
        error: BaseException
        try:
            cls: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                cls = getattr(cls, part)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                raise TypeError("not an Exception class")
            error = cls(text)
        except Exception:
            error = RemoteRankError(
                f"rank {self.rank} failed while {self.phase}: {self.qualname}: {self.message}{others}"
            )
        for name, value in self.attributes.items():
            with contextlib.suppress(Exception):
                setattr(error, name, value)
        with contextlib.suppress(Exception):
            error.origin_rank = self.rank  # type: ignore[attr-defined]
        return error


def mark_origin(error: BaseException, rank: int) -> None:
    """Record on ``error`` the rank it happened on (unless it already names one)."""
    if getattr(error, "origin_rank", None) is None:
        with contextlib.suppress(Exception):
            error.origin_rank = rank  # type: ignore[attr-defined]


def raise_failures(failures: list[RankFailure | None], local: BaseException | None, rank: int) -> None:
    """Raise on this rank what ``failures`` (one entry per rank, None where the step succeeded) say: the
    lowest failing rank's exception, as its own type, on every rank (the original object on that rank)."""
    failed = sorted((f for f in failures if f is not None), key=lambda f: f.rank)
    if not failed:
        if local is not None:  # cannot happen when the local failure was gathered; kept for safety
            raise local
        return
    first = failed[0]
    if local is not None and first.rank == rank:
        mark_origin(local, rank)
        raise local
    error = first.to_exception([f.rank for f in failed[1:]])
    if local is not None:
        raise error from local
    raise error


def format_exception(e: BaseException) -> str:
    """``e`` as its type and message on one line (no traceback), for reports and logs."""
    return "".join(traceback.format_exception_only(type(e), e)).strip()
