"""The device suite's summary: the rows (medians of every sample), the ratios the targets are stated in, the memory
figures, and their markdown tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.core.report import Report, fmt_bytes
from benchmarks.core.timing import median

Rows = dict[str, dict[str, Any]]


def column(results: dict[str, list[Any]], name: str, key: str, sub: str | None = None) -> list[Any]:
    """``key`` of every sample of ``name`` (of its ``sub`` dict when given; the sample itself when not a dict)."""
    items = results.get(name, [])
    if sub is not None:
        return [x.get(sub, {}).get(key) for x in items]
    return [x.get(key) if isinstance(x, dict) else x for x in items]


def row_adder(rows: Rows) -> Callable[[str, list[Any]], None]:
    """A function that adds a row (median and every sample present) to ``rows``, when it has samples."""

    def row(label: str, values: list[Any]) -> None:
        values = [v for v in values if v is not None]
        if values:
            rows[label] = {"median": median(values), "all": values}

    return row


def first_rows(row: Callable, firsts: list[dict], samples: dict[str, list[dict]]) -> None:
    """The first saves: this process's and the fresh children's, after prepare_async_save, after a resume."""
    prepared, resumed, resumed_off = (samples[k] for k in ("prepared", "resumed", "resumed_off"))
    row("nxd first async: blocked s", [f["call_s"] for f in firsts])
    row("nxd first async: next training step (synced) s", [f.get("step_after_s") for f in firsts])
    row("nxd first async: durable s", [f["durable_s"] for f in firsts])
    row("nxd first async: page faults in the call", [f.get("call_minflt") for f in firsts])
    row("nxd first async: graph compiles in the call", [f.get("call_compiles") for f in firsts])
    row("prepare_async_save s", [p.get("prepare_s") for p in prepared])
    row("prepare_async_save: graph compiles", [p.get("prepare_compiles") for p in prepared])
    row("nxd first async after prepare_async_save: blocked s", [p["first"]["call_s"] for p in prepared])
    row("nxd first async after prepare_async_save: durable s", [p["first"]["durable_s"] for p in prepared])
    row("nxd first async after prepare_async_save: graph compiles in the call",
        [p["first"].get("call_compiles") for p in prepared])  # fmt: skip
    row("resume: load_checkpoint of an async-saved tag (prepares the next save) s", [x["load_s"] for x in resumed])
    row("resume: load_checkpoint: graph compiles", [x["load_compiles"] for x in resumed])
    row("nxd first async after a resume: blocked s", [x["first"]["call_s"] for x in resumed])
    row("nxd first async after a resume: durable s", [x["first"]["durable_s"] for x in resumed])
    row("nxd first async after a resume: graph compiles in the call",
        [x["first"].get("call_compiles") for x in resumed])  # fmt: skip
    row("resume, PREPARE_ON_RESUME=0: load_checkpoint s", [x["load_s"] for x in resumed_off])
    row("nxd first async after a resume, PREPARE_ON_RESUME=0: blocked s", [x["first"]["call_s"] for x in resumed_off])
    row("nxd first async after a resume, PREPARE_ON_RESUME=0: graph compiles in the call",
        [x["first"].get("call_compiles") for x in resumed_off])  # fmt: skip


def async_rows(row: Callable, r: dict[str, list[Any]]) -> None:
    """The steady async saves of each kind, and DCP's."""
    for name, label in (
        ("nxd_async", "nxd async xser"),
        ("nxd_async_plain", "nxd async plain"),
        ("nxd_async_nosnap", "nxd async xser, device_snapshot_budget=0"),
        ("dcp_async", "dcp async_save"),
    ):
        row(f"{label}: blocked s", column(r, name, "call_s"))
        row(f"{label}: report blocked_s", column(r, name, "blocked_s", "report"))
        row(f"{label}: device_direct_s", column(r, name, "device_direct_s", "report"))
        row(f"{label}: next training step (synced) s", column(r, name, "step_after_s"))
        row(f"{label}: durable s", column(r, name, "durable_s"))
        row(f"{label}: page faults in the call", column(r, name, "call_minflt"))
        row(f"{label}: graph compiles in the call", column(r, name, "call_compiles"))


def today_rows(row: Callable, today: dict | None) -> None:
    """Today's tree and this tree, each in a child of its own: first, steady and while training goes on."""
    if not today:
        return
    row("today's nxd first async: blocked s", [today["first"]["call_s"]])
    row("today's nxd first async: durable s", [today["first"]["durable_s"]])
    row("today's nxd first async: page faults in the call", [today["first"].get("call_minflt")])
    row("today's nxd first async: next training step (synced) s", [today["first"].get("step_after_s")])
    row("today's nxd async xser: next training step (synced) s", [x.get("step_after_s") for x in today["steady"]])
    row("today's nxd async xser: blocked s", [x["call_s"] for x in today["steady"]])
    row("today's nxd async xser: durable s", [x["durable_s"] for x in today["steady"]])
    mine = today.get("this_tree")
    if mine:
        row("this tree in a child like today's, async xser: blocked s", [x["call_s"] for x in mine["steady"]])
        row("this tree in a child like today's, async xser: next training step (synced) s",
            [x.get("step_after_s") for x in mine["steady"]])  # fmt: skip
        row("this tree in a child like today's, async xser: durable s", [x["durable_s"] for x in mine["steady"]])
    for who, figures in (("today's", today), ("this tree's", mine)):
        for key, what in (("call_s", "blocked s"), ("durable_s", "durable s"), ("lost_s", "training time lost s"),
                          ("steps", "steps until durable")):  # fmt: skip
            if figures and figures.get("training"):
                row(f"{who} nxd async xser while training goes on: {what}", [x[key] for x in figures["training"]])


def summary_rows(
    r: dict[str, list[Any]], firsts: list[dict], samples: dict[str, list[dict]], today: dict | None
) -> Rows:
    """Every row of the summary, in the order of the table."""
    rows: Rows = {}
    row = row_adder(rows)
    row("floor: device->host copy (pinned / bulk) s", r.get("floor_copy_s", []))
    row("floor: device clone + sync s", r.get("floor_clone_s", []))
    row("floor: disk write + fsync s", r.get("floor_disk_s", []))
    row("one training step (synced), no save in flight s", r.get("floor_step_s", []))
    first_rows(row, firsts, samples)
    async_rows(row, r)
    today_rows(row, today)
    row("step alone: device time s", r.get("step_alone", []))
    row("step + async save before its sync: device time s", r.get("step_save_before_sync", []))
    row("nxd async xser, device filled to within 10%: blocked s", column(r, "pressure", "call_s"))
    row("nxd async xser, device filled to within 10%: durable s", column(r, "pressure", "durable_s"))
    row("nxd sync save (xser) s", column(r, "nxd_sync", "call_s"))
    row("torch.save + fsync s", column(r, "torch_save", "s"))
    row("load: nxd load_checkpoint s", column(r, "load_nxd", "s"))
    row("load: torch.load + load_state_dict s", column(r, "load_torch", "s"))
    row("load: dcp.load + load_state_dict s", column(r, "load_dcp", "s"))
    return rows


STEADY = "nxd async xser: blocked s"
RATIOS: tuple[tuple[str, str, str, str], ...] = (
    ("steady async blocked / pinned d2h copy", STEADY, "floor: device->host copy (pinned / bulk) s", "<= 1.5 (GPU)"),
    ("steady async blocked / device clone + sync", STEADY, "floor: device clone + sync s", "<= 1.5 (XLA)"),
    ("first async blocked / steady async blocked", "nxd first async: blocked s", STEADY, "<= 1.5"),
    ("async blocked, device filled to within 10% / steady async blocked",
     "nxd async xser, device filled to within 10%: blocked s", STEADY, ""),
    ("async durable, device filled to within 10% / steady async durable",
     "nxd async xser, device filled to within 10%: durable s", "nxd async xser: durable s", ""),
    ("step + save before its sync / step alone (device time)", "step + async save before its sync: device time s",
     "step alone: device time s", "<= 1.35"),
    ("first async after prepare_async_save blocked / steady async blocked",
     "nxd first async after prepare_async_save: blocked s", STEADY, ""),
    ("first async after a resume blocked / steady async blocked", "nxd first async after a resume: blocked s",
     STEADY, "<= 1.5"),
    ("first async after a resume with PREPARE_ON_RESUME=0 blocked / steady async blocked",
     "nxd first async after a resume, PREPARE_ON_RESUME=0: blocked s", STEADY, ""),
    ("resume load that prepares / resume load with PREPARE_ON_RESUME=0",
     "resume: load_checkpoint of an async-saved tag (prepares the next save) s",
     "resume, PREPARE_ON_RESUME=0: load_checkpoint s", ""),
    ("steady async: next training step / a step alone", "nxd async xser: next training step (synced) s",
     "one training step (synced), no save in flight s", ""),
    ("first async: next training step / a step alone", "nxd first async: next training step (synced) s",
     "one training step (synced), no save in flight s", ""),
    ("steady async durable / nxd sync save", "nxd async xser: durable s", "nxd sync save (xser) s", ""),
    ("steady async durable / today's async durable", "nxd async xser: durable s",
     "today's nxd async xser: durable s", ""),
    ("steady async durable, each in a child of its own: this tree / today's",
     "this tree in a child like today's, async xser: durable s", "today's nxd async xser: durable s",
     "<= 1.0 (no worse)"),
    ("async durable while training goes on, each in a child of its own: this tree / today's",
     "this tree's nxd async xser while training goes on: durable s",
     "today's nxd async xser while training goes on: durable s", "<= 1.0 (no worse)"),
    ("training time lost to an async save while training goes on: this tree / today's",
     "this tree's nxd async xser while training goes on: training time lost s",
     "today's nxd async xser while training goes on: training time lost s", ""),
    ("steady async durable / device_snapshot_budget=0 durable", "nxd async xser: durable s",
     "nxd async xser, device_snapshot_budget=0: durable s", ""),
    ("steady async blocked / today's async blocked", STEADY, "today's nxd async xser: blocked s", ""),
    ("steady async blocked / device_snapshot_budget=0 blocked", STEADY,
     "nxd async xser, device_snapshot_budget=0: blocked s", ""),
    ("today's first async blocked / nxd first async blocked", "today's nxd first async: blocked s",
     "nxd first async: blocked s", ""),
    ("steady async blocked / dcp async_save blocked", STEADY, "dcp async_save: blocked s", ""),
    ("nxd sync save / disk floor", "nxd sync save (xser) s", "floor: disk write + fsync s", ""),
    ("torch.save / nxd sync save (speed-up)", "torch.save + fsync s", "nxd sync save (xser) s", ""),
    ("torch.load + load_state_dict / nxd load (speed-up)", "load: torch.load + load_state_dict s",
     "load: nxd load_checkpoint s", ">= 1.0"),
    ("dcp.load / nxd load (speed-up)", "load: dcp.load + load_state_dict s", "load: nxd load_checkpoint s", ""),
)  # fmt: skip
"""(ratio, numerator row, denominator row, target): every ratio of the summary, of the rows' medians."""


def summary_ratios(rows: Rows, gpu: bool) -> list[dict[str, Any]]:
    """Each ratio of ``RATIOS`` (its value None where a row is missing); a target for the other device kind's
    floor is left blank."""
    out = []
    for label, top, bottom, target in RATIOS:
        a, b = rows.get(top, {}).get("median"), rows.get(bottom, {}).get("median")
        if (target.endswith("(GPU)") and not gpu) or (target.endswith("(XLA)") and gpu):
            target = ""
        out.append({"ratio": label, "value": a / b if a is not None and b else None, "target": target})
    return out


def summary_memory(r: dict[str, list[Any]], firsts: list[dict]) -> dict[str, Any]:
    """The memory figures: the largest of each path's samples."""
    memory: dict[str, Any] = {}

    def mem(label: str, values: list[Any]) -> None:
        values = [v for v in values if v is not None]
        memory[label] = max(values) if values else None

    mem("nxd first async: extra device memory (peak)", [f.get("dev_peak") for f in firsts])
    mem("nxd first async: device_snapshot_bytes", [f["report"].get("device_snapshot_bytes") for f in firsts])
    mem("nxd first async: extra host memory (resident)", [f.get("first_host_rss") for f in firsts])
    for name, label in (("nxd_async", "nxd async xser"), ("nxd_async_plain", "nxd async plain"),
                        ("nxd_async_nosnap", "nxd async, budget 0"), ("nxd_sync", "nxd sync"),
                        ("dcp_async", "dcp async_save")):  # fmt: skip
        mem(f"{label}: extra device memory (peak)", column(r, name, "dev_peak"))
        if name.startswith("nxd_async"):
            mem(f"{label}: device_snapshot_bytes", column(r, name, "device_snapshot_bytes", "report"))
    for name, label in (("load_nxd", "nxd load"), ("load_torch", "torch.load"), ("load_dcp", "dcp.load")):
        mem(f"{label}: extra device memory (peak)", column(r, name, "dev_peak"))
    mem("nxd async (untimed run): extra host memory", column(r, "mem_async", "host_extra"))
    mem("nxd sync (untimed run): extra host memory", column(r, "mem_sync", "host_extra"))
    mem("nxd load (untimed run): extra host memory", column(r, "mem_load", "host_extra"))
    return memory


def build_summary(run: Any, firsts: list[dict], samples: dict[str, list[dict]], today: dict | None,
                  meta: dict) -> dict[str, Any]:  # fmt: skip
    """Everything the run measured, summarised: meta, rows, ratios, memory, every sample, errors and checks."""
    rows = summary_rows(run.results, firsts, samples, today)
    return {
        "meta": meta,
        "rows": rows,
        "ratios": summary_ratios(rows, run.dev.kind == "cuda"),
        "memory": summary_memory(run.results, firsts),
        "first": firsts,
        "first_after_prepare": samples["prepared"],
        "first_after_resume": samples["resumed"],
        "first_after_resume_unprepared": samples["resumed_off"],
        "today": today,
        "results": run.results,
        "errors": run.errors,
        "checks": run.checks,
    }


def print_summary(report: Report, summary: dict[str, Any]) -> None:
    """The summary's header and its three tables (rows, ratios, memory), then the checks and failures."""
    meta = summary["meta"]
    report.say()
    report.say(
        f"## {meta['device']}: {meta['state_gb']:.3f} GB of fp32 state ({meta['tensors']} tensors), "
        f"{meta['reps']} reps (median), loads {'cold' if meta['cold'] else 'WARM (' + meta['warm_why'] + ')'}"
    )
    report.say(
        f"{meta['versions']}; nxd_ckpt from {meta['nxd_ckpt']}; load average {meta['load_start']:.2f} at start, "
        f"{meta['load_end']:.2f} at end"
    )
    report.say()
    report.say("| measurement | median | GB/s | all |")
    report.say("|---|---:|---:|---|")
    gb = meta["state_gb"]
    for label, v in summary["rows"].items():
        rate = f"{gb / v['median']:.2f}" if v["median"] and "device_direct" not in label else ""
        report.say(f"| {label} | {v['median']:.3f} | {rate} | {', '.join(f'{x:.3f}' for x in v['all'])} |")
    report.say()
    report.say("| ratio | value | target |")
    report.say("|---|---:|---|")
    for r in summary["ratios"]:
        value = f"{r['value']:.2f}" if r["value"] is not None else "n/a"
        report.say(f"| {r['ratio']} | {value} | {r['target']} |")
    report.say()
    report.say("| memory (largest) | bytes |")
    report.say("|---|---:|")
    for label, v in summary["memory"].items():
        report.say(f"| {label} | {fmt_bytes(v)} |")
    if summary["checks"]:
        report.say()
        for what, outcome in summary["checks"].items():
            report.say(f"check: {what}: {outcome}")
    for name, error in summary["errors"].items():
        report.say(f"FAILED: {name}: {error.splitlines()[0] if error else ''}")
