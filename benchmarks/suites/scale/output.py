"""The scale suite's rows as they are measured (one line each, so a long run stopped part-way keeps them)."""

from __future__ import annotations

from typing import Any

COLUMNS = [
    ("op", "{:<10}"),
    ("ranks", "{:>5}"),
    ("layout", "{:<14}"),
    ("coordination_s", "{:>7.3f}"),
    ("critical_s", "{:>7.3f}"),
    ("releases", "{:>3}"),
    ("projected_s", "{:>7.3f}"),
    ("parallel_s", "{:>7.3f}"),
    ("parallel_projected_s", "{:>7.3f}"),
    ("steps", "{:>3}"),
    ("store_ops_mean", "{:>6.1f}"),
    ("store_ops_max", "{:>5}"),
    ("store_wait_ops_max", "{:>4}"),
    ("collectives_max", "{:>4}"),
    ("recv_bytes_max", "{:>9}"),
    ("files", "{:>8}"),
    ("busiest_prefix_requests", "{:>8}"),
    ("s3_s_busiest_prefix", "{:>7.2f}"),
    ("s3_s_one_prefix", "{:>7.2f}"),
    ("wall_s", "{:>7.1f}"),
]
HEADERS = {
    "coordination_s": "coord s",
    "critical_s": "crit s",
    "releases": "rel",
    "projected_s": "proj s",
    "parallel_s": "par s",
    "parallel_projected_s": "ppar s",
    "steps": "stp",
    "store_ops_mean": "st.ops",
    "store_ops_max": "max",
    "store_wait_ops_max": "wait",
    "collectives_max": "coll",
    "recv_bytes_max": "recv B",
    "busiest_prefix_requests": "req/pfx",
    "s3_s_busiest_prefix": "S3 s/pfx",
    "s3_s_one_prefix": "S3 s/1pfx",
    "wall_s": "wall s",
}


def print_header() -> None:
    """The header line of the rows."""
    print(" | ".join(HEADERS.get(k, k) for k, _ in COLUMNS), flush=True)


def print_row(row: dict[str, Any]) -> None:
    """One row, as soon as it is measured (a long run stopped part-way keeps what it measured)."""
    print(" | ".join(fmt.format(row[k]) for k, fmt in COLUMNS), flush=True)


def print_requests(rows: list[dict[str, Any]]) -> None:
    """The requests of each operation by kind, and its busiest key prefix."""
    print("\nrequests by kind (per operation):")
    for row in rows:
        print(f"  {row['op']:<10} {row['ranks']:>5} ranks: {row['requests']}  busiest prefix {row['busiest_prefix']}")
