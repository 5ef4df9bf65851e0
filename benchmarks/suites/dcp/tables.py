"""The dcp suite's report of one section: the saves (blocked, durable, peak extra host memory), the loads, the
target ratios with their verdicts, and what each path was told or could not do."""

from __future__ import annotations

from typing import Any

from benchmarks.core.report import Report, fmt_bytes, verdict
from benchmarks.core.timing import median

Figure = tuple[str, str | None]
"""A row key and the field of it (``blocked_s``, ``durable_s``; None for a load or the baseline)."""

NXD_BLOCKED: Figure = ("nxd_async", "blocked_s")
TARGETS: dict[str, list[tuple[str, Figure, Figure, str, float]]] = {
    "cpu": [
        ("CPU state blocked: nxd async_save / memcpy of the state", NXD_BLOCKED, ("baseline", None), "<=", 1.0),
        ("CPU state blocked: nxd async_save / DCP async_save + DefaultStager", NXD_BLOCKED, ("dcp_stager", "blocked_s"),
         "<=", 1.0),
    ],
    "device": [("device state blocked: nxd async_save / DCP async_save + DefaultStager (pinned on CUDA)", NXD_BLOCKED,
                ("dcp_stager", "blocked_s"), "<=", 0.1)],
    "all": [
        ("time to durable: nxd async_save / DCP's sync dcp.save", ("nxd_async", "durable_s"), ("dcp_sync", "durable_s"),
         "<=", 1.1),
        ("load speed: dcp.load's seconds / nxd StorageReader's seconds", ("dcp_load", None), ("nxd_load", None), ">=",
         1.2),
    ],
}  # fmt: skip
INFO: list[tuple[str, Figure, Figure]] = [
    ("blocked: nxd async_save / DCP's plain async_save", NXD_BLOCKED, ("dcp_async", "blocked_s")),
    ("blocked: nxd async_save / torch_checkpointing", NXD_BLOCKED, ("tc_async", "blocked_s")),
    ("durable: nxd async_save / torch_checkpointing (+ fsync)", ("nxd_async", "durable_s"), ("tc_async", "durable_s")),
    ("durable: nxd sync dcp.save / DCP's sync dcp.save", ("nxd_sync", "durable_s"), ("dcp_sync", "durable_s")),
    ("load: torch_checkpointing's seconds / nxd StorageReader's seconds", ("tc_load", None), ("nxd_load", None)),
]
STANDING = [
    "DCP's FileSystemWriter runs with sync_files=True (its default): it fsyncs its data files and .metadata, not "
    "the folder's directory entries; with sync_files=False it fsyncs nothing. Its durable time is its future's end.",
    "nxd's durable time is the upload's end: every file and directory fsynced, checksums in the manifest, "
    ".metadata committed last once every rank's files are durable.",
    "blocked: until the caller may change the state (DCP: async_save returned and its staging ended; nxd: "
    "async_save returned; torch_checkpointing: save returned and its staging lock released).",
    "peak extra host memory: the rank process's resident peak (sampled every 2 ms) over its settled resident "
    "memory, across the path's first two saves until durable (buffers it keeps count); torch_checkpointing writes "
    "from a spawned process, whose own memory is not in it.",
]
XLA_MEMORY = (
    "on the XLA CPU device, device memory is host memory: a device snapshot (nxd's stager) counts in the "
    "host figure there, where on a GPU it would be device memory"
)


def figure(rows: list[dict[str, Any]], fig: Figure) -> float | None:
    """The median over the repetitions of one figure (None where it is missing)."""
    key, field = fig
    values = [(r.get(key) or {}).get(field) if field else r.get(key) for r in rows]
    return median(values)


def ratio_line(name: str, num: float | None, den: float | None, op: str = "", target: float | None = None) -> str:
    """One ratio, its target and verdict (``n/a`` when a figure is missing)."""
    if num is None or not den:
        return f"| {name} | n/a | {f'{op} {target:g}x' if target else ''} | |"
    value = num / den
    if target is None:
        return f"| {name} | {value:.3f}x | | |"
    ok = value <= target if op == "<=" else value >= target
    return f"| {name} | {value:.3f}x | {op} {target:g}x | {verdict(ok)} |"


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def save_rows(result: dict[str, Any], baseline: str) -> list[list[str]]:
    """The save table's rows: the baseline, then every path (missing and failed ones said)."""
    rows, labels, memory = result["rows"], result["labels"], result["peak_extra_bytes"]
    out = [[baseline, _s(figure(rows, ("baseline", None))), "", ""]]
    for key, label in labels.items():
        if key.endswith("_load"):
            continue
        blocked, durable = figure(rows, (key, "blocked_s")), figure(rows, (key, "durable_s"))
        failed = f" (failed: {result['failed'][key]})" if key in result["failed"] else ""
        out.append([label + failed, _s(blocked), _s(durable), fmt_bytes(memory.get(key))])
    return out


def load_rows(result: dict[str, Any]) -> list[list[str]]:
    """The load table's rows: seconds, peak extra host memory, and the bit-exact check."""
    rows, memory = result["rows"], result["peak_extra_bytes"]
    out = []
    for key, label in result["labels"].items():
        if key.endswith("_load"):
            failed = f" (failed: {result['failed'][key]})" if key in result["failed"] else ""
            out.append([label + failed, _s(figure(rows, (key, None))), fmt_bytes(memory.get(key)),
                        result["checks"].get(key, "not checked")])  # fmt: skip
    return out


def print_section(report: Report, name: str, result: dict[str, Any]) -> None:
    """The section's tables, ratios (kept in ``result["ratios"]`` for the JSON too) and notes."""
    if "skipped" in result:
        report.say(f"== dcp {name}: skipped: {result['skipped']} ==")
        return
    where = f"on {result['ranks']} gloo ranks" if name == "cpu" else f"on {result.get('device', name)}, one rank"
    report.say(f"== dcp {name}: {fmt_bytes(result['total_bytes'])} of state {where} (bytes per rank "
               f"{', '.join(fmt_bytes(b) for b in result['bytes_per_rank'])}); {len(result['rows'])} interleaved "
               "repetitions, medians of the slowest rank ==")  # fmt: skip
    baseline = "baseline: memcpy of the rank's state into a touched buffer" if name == "cpu" else (
        "baseline: device -> host copy floor (CUDA: pinned buffers kept; XLA: one bulk transfer)")  # fmt: skip
    report.table(["save", "blocked s", "durable s", "peak extra host memory"], save_rows(result, baseline))
    report.say()
    report.table(["load into the live state", "s", "peak extra host memory", "check"], load_rows(result))
    report.say()
    report.say("| ratio | value | target | verdict |")
    report.say("|---|---:|---|---|")
    rows, result["ratios"] = result["rows"], {}
    targets = [(label, num, den, op, target) for label, num, den, op, target in TARGETS[
        "cpu" if name == "cpu" else "device"] + TARGETS["all"]]  # fmt: skip
    for label, num, den, op, target in targets + [(label, num, den, "", None) for label, num, den in INFO]:
        n, d = figure(rows, num), figure(rows, den)
        result["ratios"][label] = n / d if n is not None and d else None
        report.say(ratio_line(label, n, d, op, target))
    report.say()
    for key, why in result.get("missing", {}).items():
        report.say(f"- {key}: missing: {why}")
    for key, notes in result.get("notes", {}).items():
        report.say(f"- {key}: " + "; ".join(notes))
    for line in STANDING + ([XLA_MEMORY] if name == "xla" else []):
        report.say(f"- {line}")
    report.say()
