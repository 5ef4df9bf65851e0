"""The saveload suite's report: the table of medians against the disk, every repetition, and the targets of the
resume, async, host-memory, first-save and memory-tier rows, each with MET / NOT MET."""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from benchmarks.core.report import Report, verdict
from benchmarks.core.timing import joined, median
from benchmarks.measure.first_save import ratio_line
from benchmarks.suites.saveload.bench import REGISTRY

GIB = 1 << 30
Medians = dict[str, tuple[Any, Any]]


def medians(data: dict) -> Medians:
    """Each section's (save, load) medians."""
    return {n: (median([t[0] for t in ts]), median([t[1] for t in ts])) for n, ts in data["results"].items()}


def table(report: Report, data: dict, med: Medians, ranks: int, reps: int) -> None:
    """The state line, the table of medians and ratios to the disk, and every repetition."""
    gb = data["bytes"] / 1e9
    base_w, base_r = med.get("raw_dd", (None, None))
    report.say(
        f"state: {data['bytes'] / GIB:.2f} GiB of tensor data ({gb:.2f} GB), {ranks} ranks, {reps} reps "
        f"(median), loads {'cold (page cache dropped)' if data['cold'] else 'WARM'}, torch {torch.__version__}"
    )
    report.say()
    rows = []
    for name, (s, ld) in med.items():
        xw = f"{base_w / s:.2f}" if base_w else ""
        xr = f"{base_r / ld:.2f}" if base_r and ld else ""
        load = ("-", "-", "-") if ld is None else (f"{ld:.2f}", f"{gb / ld:.2f}", xr)
        rows.append([REGISTRY[name][0], f"{s:.2f}", f"{gb / s:.2f}", xw, *load])
    report.table(["system", "save s", "save GB/s", "x disk write", "load s", "load GB/s", "x disk read"], rows)
    report.say()
    for name, ts in data["results"].items():
        report.say(f"- {name}: save [{joined([t[0] for t in ts], '{:.2f}')}] s, "
                   f"load [{joined([t[1] for t in ts], '{:.2f}')}] s")  # fmt: skip


RESUME_RATIOS = (
    ("nxd_xser_live", "torch_load_live", "live-module load vs torch.load + load_state_dict (target >= 1.0)", 1),
    ("nxd_xser_live", "raw_dd", "live-module load vs cold dd read (target >= 0.9)", 1),
    ("nxd_xser_fresh", "raw_dd", "fresh-dict load vs cold dd read", 1),
    ("nxd_xser_live", "nxd_xser_fresh", "live-module load vs fresh-dict load", 1),
    ("nxd_xser_live_xla", "torch_xla_xser_live", "device load vs xser.load + load_state_dict (target >= 1.0)", 1),
    ("nxd_save_keep", "nxd_save_nokeep", "sync save with retention vs without (target >= 1.0 beyond noise)", 0),
)
"""(ours, theirs, what, column): resume and retention ratios, theirs / ours (column 0 save, 1 load)."""


def resume_lines(data: dict, med: Medians) -> list[str]:
    """The resume targets: cold load into the live module >= 1.0x torch.load + load_state_dict and >= 0.9x dd;
    onto the device >= 1.0x torch_xla's xser.load + load_state_dict; a sync save with retention no slower."""
    lines = []
    for mine, other, what, col in RESUME_RATIOS:
        if mine in med and other in med and med[mine][col] and med[other][col]:
            lines.append(f"resume: {what}: {med[other][col] / med[mine][col]:.2f}x")
    extra = data.get("extra", {})
    for name in ("torch_load_live", "nxd_xser_live", "nxd_xser_fresh", "torch_xla_xser_live", "nxd_xser_live_xla"):
        peaks = [r["peak_gb"] for r in extra.get(name, []) if "peak_gb" in r]
        if peaks:
            rss = [r.get("peak_rss_gb", 0.0) for r in extra[name]]
            lines.append(f"resume: {name}: peak extra host memory during the load (largest rank; heap or new pages) "
                         f"median {statistics.median(peaks):.3f} GB [{joined(peaks)}], new resident pages "
                         f"{statistics.median(rss):.3f} GB")  # fmt: skip
    return ["", *lines] if lines else []


def versus_lines(med: Medians) -> list[str]:
    """nxd_xser's speed-up over torch_xla's xser, DCP and torch.save, where they ran."""
    if "nxd_xser" not in med or med["nxd_xser"][1] is None:
        return []
    s, ld = med["nxd_xser"]
    lines = [""]
    for other in ("torch_xla_xser", "dcp", "torch_save"):
        if other in med:
            lines.append(f"nxd_xser vs {other}: save {med[other][0] / s:.2f}x faster, load {med[other][1] / ld:.2f}x "
                         "faster")  # fmt: skip
    return lines


def async_lines(data: dict, med: Medians) -> list[str]:
    """The async targets: blocked <= 1.25x memcpy and below DCP's async_save; total <= 1.1x the sync save."""
    runs = data.get("extra", {}).get("nxd_async")
    if not runs:
        return []
    a = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    paired = statistics.median(r["blocked_s"] / r["memcpy_s"] for r in runs)
    lines = ["", f"async: nxd async_save blocks {a['blocked_s']:.3f} s (staging {a['staging_s']:.3f} s); memcpy of the "
             f"same bytes into a touched buffer {a['memcpy_s']:.3f} s: blocked / memcpy "
             f"{a['blocked_s'] / a['memcpy_s']:.2f} (median per repetition {paired:.2f}; target <= 1.25)"]  # fmt: skip
    if "nxd_plain" in med:
        ratio = med["nxd_async"][0] / med["nxd_plain"][0]
        lines.append(f"async: total until durable {med['nxd_async'][0]:.2f} s = {ratio:.2f}x the sync save "
                     "(target <= 1.1)")  # fmt: skip
    if "dcp_async" in data["extra"]:
        dcp_blocked = statistics.median(r["blocked_s"] for r in data["extra"]["dcp_async"])
        lines.append(f"async: DCP async_save blocks {dcp_blocked:.3f} s and is done after {med['dcp_async'][0]:.2f} "
                     f"s; nxd blocked / DCP blocked {a['blocked_s'] / dcp_blocked:.2f} (target < 1)")  # fmt: skip
    lines.append("async: peak extra host memory: python -m benchmarks async")
    return lines


def first_async_lines(first: dict | None) -> list[str]:
    """The first async save of the process against the next ones, and training beside prepare_async_save."""
    if not first:
        return []
    lines = ["  " + ratio_line(first["process_first_async_s"], first["process_steady_async_s"])]
    if "prepare_call_s" in first:
        slow = first["step_during_prepare_s"] / first["step_after_prepare_s"]
        lines.append(f"    after prepare_async_save (returned in {first['prepare_call_s'] * 1e3:.1f} ms; buffers "
                     f"faulted in {first['prepare_faulted_s']:.2f} s beside {first['steps_during_prepare']} training "
                     f"steps): a step took {first['step_during_prepare_s'] * 1e3:.1f} ms meanwhile, "
                     f"{first['step_after_prepare_s'] * 1e3:.1f} ms otherwise ({slow:.2f}x; host work of a stand-in "
                     "step, 2 ranks on this VM's 2 cores)")  # fmt: skip
    return lines


def load_ratio_lines(med: Medians) -> list[str]:
    """Verified nxd loads against torch.load (fresh dicts) and torch.load + load_state_dict (live module)."""
    lines = []
    for mine, theirs, what in (
        ("nxd_plain_verified", "torch_save", "plain, verified, fresh dicts vs torch.load"),
        ("nxd_xser_fresh" if "nxd_xser_fresh" in med else "nxd_xser", "torch_save",
         "xser, verified, fresh dicts vs torch.load"),
        ("nxd_plain_live", "torch_load_live", "plain, verified, live module vs torch.load + load_state_dict"),
        ("nxd_xser_live", "torch_load_live", "xser, verified, live module vs torch.load + load_state_dict"),
    ):  # fmt: skip
        if mine in med and theirs in med and med[mine][1] and med[theirs][1]:
            r = med[theirs][1] / med[mine][1]
            lines.append(f"  load {what}: {r:.2f}x {theirs} (target >= 1.0): {verdict(r >= 1.0)}")
    return lines


def memory_lines(runs: list[dict[str, float]]) -> list[str]:
    """The nxd_memory section's lines: a fresh manager's first async save, peak memory per path, the budget."""
    if not runs:
        return []
    first = statistics.median(r["first_async_blocked_s"] for r in runs)
    steady = statistics.median(r["steady_async_blocked_s"] for r in runs)
    ratio = statistics.median(r["first_async_blocked_s"] / r["steady_async_blocked_s"] for r in runs)
    lines = [f"  without prepare_async_save, the first async save of a fresh manager blocks {first:.3f} s, steady "
             f"{steady:.3f} s: {ratio:.2f}x (no target: its staging memory is faulted in during the call)"]  # fmt: skip
    for key, what in (
        ("mem_sync", "sync save"),
        ("mem_async", "async save"),
        ("mem_async_budget", "async save, budget = 1/4 of the state"),
        ("mem_load_fresh", "verified load into fresh dicts (holds the loaded state: 1.0 = no extra)"),
    ):
        values = [r[key] for r in runs]
        lines.append(f"  peak extra host memory, {what}: {statistics.median(values):.2f}x the rank's state "
                     f"[{joined(values, '{:.2f}')}]")  # fmt: skip
    budget_ok = all(r["mem_async_budget_over_bytes"] <= 64 << 20 for r in runs)
    waited = statistics.median(r["budget_wait_s"] for r in runs)
    lines.append(f"  async save under a budget of 1/4 of the state holds <= budget + 64 MiB: {verdict(budget_ok)}; "
                 f"the call waited {waited:.3f} s for what did not fit")  # fmt: skip
    return lines


def tier_lines(tier: list[dict[str, float]]) -> list[str]:
    """The memory-tier targets: restore from node memory <= 1.5x a memcpy, from the peer <= 2x a socket copy."""
    if not tier:
        return []
    mem = statistics.median(r["tier_memory_s"] / r["tier_memcpy_s"] for r in tier)
    lines = [f"  tier restore from node memory: {mem:.2f}x a memcpy of the same bytes (target <= 1.5): "
             f"{verdict(mem <= 1.5)}"]  # fmt: skip
    if "tier_peer_s" in tier[0]:
        lines += peer_lines(tier)
    for label in ("memory", "peer"):
        values = [r[f"mem_tier_{label}"] for r in tier if f"mem_tier_{label}" in r]
        if values:
            lines.append(f"  peak extra host memory, tier restore from {label}: {statistics.median(values):.2f}x "
                         "the rank's state")  # fmt: skip
    return lines


def peer_lines(tier: list[dict[str, float]]) -> list[str]:
    """The peer restore against the socket copy alone and while the sender copies its own state; CPU time."""
    peer = statistics.median(r["tier_peer_s"] / r["tier_socket_s"] for r in tier)
    lines = [f"  tier restore from the peer: {peer:.2f}x a loopback socket copy of the same bytes (target <= 2.0): "
             f"{verdict(peer <= 2.0)}"]  # fmt: skip
    if "tier_cpu_peer" in tier[0]:
        cores = os.cpu_count() or 1
        floor = statistics.median(r["tier_cpu_peer"] / cores / r["tier_socket_s"] for r in tier)
        lines.append(f"    CPU time of both ranks: restore from the peer "
                     f"{statistics.median(r['tier_cpu_peer'] for r in tier):.2f} CPU-s, the socket copy "
                     f"{statistics.median(r['tier_cpu_socket'] for r in tier):.2f}; on {cores} cores the restore's "
                     f"work alone takes at least {floor:.2f}x the socket copy")  # fmt: skip
    serving = statistics.median(r["tier_peer_s"] / r["tier_socket_serving_s"] for r in tier)
    lines.append(f"  tier restore from the peer: {serving:.2f}x the same socket copy while the sending rank copies "
                 f"its own state, as it does in the restore (target <= 2.0): {verdict(serving <= 2.0)}")  # fmt: skip
    return lines


def write(report: Report, data: dict, ranks: int, reps: int) -> None:
    """The whole report of one run."""
    med = medians(data)
    table(report, data, med, ranks, reps)
    extra = data.get("extra", {})
    lines = resume_lines(data, med) + versus_lines(med) + async_lines(data, med)
    lines += ["", "memory sections (each ratio taken within this run):", *load_ratio_lines(med)]
    lines += first_async_lines(data.get("first_async")) + memory_lines(extra.get("nxd_memory", []))
    lines += tier_lines(extra.get("nxd_tier", []))
    for line in lines:
        report.say(line)
