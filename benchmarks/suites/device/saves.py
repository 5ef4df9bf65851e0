"""One nxd save of the training state, timed as the device suite times every save (the call, the next
training step, durable; page faults and graph compiles in the call; device memory), and its one-line description."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from benchmarks.core.devices import Device, Training
from benchmarks.core.report import fmt_bytes
from benchmarks.measure.first_save import probe

REPORT_FIELDS = (
    "blocked_s",
    "waited_s",
    "staging_s",
    "staging_allocated_bytes",
    "device_snapshot_bytes",
    "device_direct_bytes",
    "device_direct_s",
    "device_budget_bytes",
    "budget_wait_s",
    "budget_peak_bytes",
    "budget_overdrawn_bytes",
    "bytes_written",
    "write_s",
    "total_s",
)


def report_fields(report: Any) -> dict[str, Any]:
    """The SaveReport's figures this benchmark knows about, those this nxd_ckpt has (getattr)."""
    return {k: getattr(report, k) for k in REPORT_FIELDS if hasattr(report, k)}


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword ``name`` (an older nxd_ckpt may not)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def nxd_save(
    dev: Device, path: str, tag: str, tr: Training, *, xser: bool, async_save: bool, extra: dict | None = None
) -> dict[str, Any]:
    """One timed nxd save of ``tr``'s state (``measure.first_save.probe``: the call's wall time and page faults):
    report fields, graph compiles in the call, durable time, device peak; after an async call, one training step
    (device synced) before the wait, timed."""
    import nxd_ckpt as nxd

    base = dev.mem_start()
    compiles, start = dev.compiles(), time.perf_counter()
    kw = {"model": tr.model, "optimizer": tr.opt, "use_xser": xser, "async_save": async_save, **(extra or {})}
    report, probed = probe(lambda: nxd.save_checkpoint(path, tag, **kw))
    counters = {"call_minflt": probed["faults"], "call_compiles": dev.compiles() - compiles}
    peak_call = dev.mem_peak(base)
    if async_save:  # the training thread's next step, device synced: what the snapshot still costs training
        step_start = time.perf_counter()
        tr.steps(1)
        counters["step_after_s"] = time.perf_counter() - step_start
    report.wait()
    durable_s = time.perf_counter() - start
    out = {"call_s": probed["blocked_s"], "durable_s": durable_s, "dev_peak_call": peak_call}
    out |= {"dev_peak": dev.mem_peak(base), **counters}
    return out | {"report": report_fields(report)}


def describe_save(figures: dict[str, Any]) -> str:
    """One save's figures on one line."""
    r = figures.get("report", {})
    parts = [f"blocked {figures['call_s']:.3f} s"]
    details = [f"report blocked_s {r['blocked_s']:.3f} s"] if "blocked_s" in r else []
    details += [f"staging {r['staging_s']:.3f} s"] if "staging_s" in r else []
    if r.get("waited_s", 0) >= 0.001:
        details.append(f"waited {r['waited_s']:.3f} s")
    for key in ("device_snapshot_bytes", "device_direct_bytes"):
        if key in r:
            details.append(f"{key.removesuffix('_bytes').replace('_', ' ')} {fmt_bytes(r[key])}")
    if "device_direct_s" in r:
        details.append(f"device direct {r['device_direct_s']:.3f} s")
    if r.get("staging_allocated_bytes"):
        details.append(f"host staging allocated {fmt_bytes(r['staging_allocated_bytes'])}")
    if r.get("budget_peak_bytes"):  # under a host memory budget (NXD_CKPT_HOST_MEMORY_BUDGET)
        details.append(
            f"host budget: waited {r.get('budget_wait_s', 0):.3f} s, copies held at most "
            f"{fmt_bytes(r['budget_peak_bytes'])}, overdrawn {fmt_bytes(r.get('budget_overdrawn_bytes', 0))}"
        )
    parts[0] += f" ({', '.join(details)})" if details else ""
    if "call_minflt" in figures:
        parts.append(f"{figures['call_minflt']} page faults and {figures['call_compiles']} graph compiles in the call")
    if "step_after_s" in figures:
        parts.append(f"next training step (synced) {figures['step_after_s']:.3f} s")
    parts.append(f"durable after {figures['durable_s']:.3f} s")
    if figures.get("dev_peak") is not None:
        parts.append(
            f"extra device memory {fmt_bytes(figures['dev_peak_call'])} in the call, "
            f"{fmt_bytes(figures['dev_peak'])} until durable"
        )
    if "first_host_rss" in figures:
        parts.append(f"extra host memory (resident) {fmt_bytes(figures['first_host_rss'])}")
    return ", ".join(parts)
