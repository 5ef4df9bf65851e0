"""The ``nxd_ckpt`` logger: quiet on every rank but the master unless asked.

nxd_ckpt logs through ``logging.getLogger("nxd_ckpt")`` and adds no handler of its own (the application decides
where logs go). With N ranks every rank would print the same save line N times, so on ranks other than global
rank 0 only warnings and errors pass; set ``NXD_CKPT_LOG_ALL_RANKS=1`` to hear from every rank. The master
logs one INFO line per save and per load with the bytes, the time, the throughput and how long training was
blocked; ``enable_logging()`` shows them on stderr for programs that do not configure logging themselves.
"""

from __future__ import annotations

import logging
import os
import sys

from nxd_ckpt import knobs

LOGGER_NAME = "nxd_ckpt"
ALL_RANKS_ENV = "NXD_CKPT_LOG_ALL_RANKS"


def process_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else the launcher's RANK, else 0."""
    from nxd_ckpt.ranks import coordinator as dist

    if dist.is_distributed():
        return dist.world_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class MasterOnlyFilter(logging.Filter):
    """Drops records below WARNING on ranks other than 0 (unless NXD_CKPT_LOG_ALL_RANKS is set)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or knobs.log_all_ranks():
            return True
        try:
            return process_rank() == 0
        except Exception:  # never let a logging filter break a save
            return True


_FILTER = MasterOnlyFilter()


def get_logger(name: str | None = None) -> logging.Logger:
    """``nxd_ckpt`` (or ``nxd_ckpt.<name>``), with the master-only filter attached."""
    logger = logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


get_logger()  # importing nxd_ckpt installs the filter


def enable_logging(level: int = logging.INFO) -> logging.Handler:
    """Show nxd_ckpt's log lines on stderr (for scripts that configure no logging); returns the handler."""
    logger = get_logger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s nxd_ckpt %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def format_bytes(n: float) -> str:
    """A size for people, in binary (IEC) units, the one convention of nxd_ckpt's text: log lines, the command's
    tables and progress bars, and the sizes the options and knobs take (``"512MiB"``). ``512 B``, ``12.1 KiB``,
    ``435 MiB``, ``4.3 GiB``: one decimal below 100 of a unit."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(nbytes: float, seconds: float) -> str:
    """Throughput for log lines (``1.2 GiB/s``, ``45.6 MiB/s``); ``-`` when the time is too short to tell."""
    return f"{format_bytes(nbytes / seconds)}/s" if seconds > 0 else "-"
