"""This process's memory mappings as Linux lists them (``/proc/self/smaps``): whether a host range is mapped, and
with which flags (``dc``: not copied into a forked child, ``MADV_DONTFORK``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    flags: frozenset[str]
    """``VmFlags`` (``dc``: dropped from a forked child)."""


def mappings() -> list[Mapping]:
    """Every mapping of this process, in address order."""
    out: list[Mapping] = []
    start = end = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = head.split("-")
                start, end = int(low, 16), int(high, 16)
            elif head == "VmFlags:" and start is not None and end is not None:
                out.append(Mapping(start, end, frozenset(line.split()[1:])))
    return out


def mapping_at(address: int) -> Mapping | None:
    """The mapping that holds ``address``, or None where nothing is mapped."""
    return next((m for m in mappings() if m.start <= address < m.end), None)
