"""The first async save of a process against the later ones: where its one-time cost goes.

Each scenario runs in a fresh process (one rank, no process group) holding ``--mib`` of CPU state in ``--tensors``
fp32 tensors (half "model", half "optimizer"), updated in place before each of ``--saves`` async saves:

  finalize     ``finalize_checkpoint()`` after every save (the staging pool is freed each time)
  keep         no finalize between saves (later saves refill the pool's buffers)
  prepared     ``prepare_async_save`` before the first save, waited for (its buffers faulted in beforehand)

Per save (``benchmarks.measure.first_save.probe``): the time of the ``nxd.save_checkpoint(...)`` call as a
training loop makes it, the staging time, the bytes the staging newly allocated, the page faults the process took
in the call and the modules it imported. Per scenario: first / median of the later saves; ``import nxd_ckpt``
(after torch) and the load average are printed apart.

    python -m benchmarks first_save                                  # 576 MiB in 36 tensors, 5 saves, all
    python -m benchmarks first_save --mib 1536 --sections keep --json out.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from benchmarks.core.child import in_child
from benchmarks.core.report import Report
from benchmarks.measure.first_save import first_vs_steady, probe

TITLE = __doc__.splitlines()[0]
SECTIONS = {
    "finalize": "finalize_checkpoint() after every save (the staging pool freed each time)",
    "keep": "no finalize between saves (later saves refill the pool's buffers)",
    "prepared": "prepare_async_save before the first save, waited for",
}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--mib", type=int, default=576, help="MiB of CPU state (default 576)")
    parser.add_argument("--tensors", type=int, default=36, help="number of fp32 tensors (default 36)")
    parser.add_argument("--saves", type=int, default=5, help="async saves per scenario (default 5, at least 2)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: the temp directory)")


def scenario(scenario: str, mib: int, tensors: int, saves: int, directory: str) -> dict[str, Any]:
    """One fresh process's run of ``scenario``: torch first, then nxd_ckpt, as a training script imports them."""
    import torch

    start = time.perf_counter()
    import nxd_ckpt as nxd

    import_s = time.perf_counter() - start
    numel = (mib << 20) // 4 // tensors
    model = {f"w{i}": torch.randn(numel) for i in range(tensors // 2)}
    exp_avg = {i: {"exp_avg": torch.randn(numel)} for i in range(tensors - tensors // 2)}
    optimizer = {"state": exp_avg, "param_groups": [{"lr": 0.1, "params": list(exp_avg)}]}
    if scenario == "prepared":
        nxd.prepare_async_save(model=model, optimizer=optimizer)
        nxd.get_manager()._staging_pool.wait_prepared()
    rows = []
    for i in range(saves):
        with torch.no_grad():  # a training step's in-place updates
            for t in list(model.values()) + [s["exp_avg"] for s in exp_avg.values()]:
                t.add_(1e-3)
        report, figures = probe(lambda i=i: nxd.save_checkpoint(
            directory, f"step_{i}", model=model, optimizer=optimizer, async_save=True, num_kept_ckpts=2))  # fmt: skip
        rows.append(figures)
        report.wait()
        if scenario == "finalize":
            nxd.finalize_checkpoint()
        else:
            nxd.get_manager().wait_pending()  # retention too: the next save waits for nothing
    nxd.finalize_checkpoint()
    return {"import_s": import_s, "saves": rows}


def report_scenario(report: Report, name: str, result: dict[str, Any]) -> None:
    """A scenario's saves, and its first / later ratio."""
    rows = result["saves"]
    report.say(f"{name}: import nxd_ckpt (after torch) {result['import_s'] * 1e3:.0f} ms")
    for i, row in enumerate(rows):
        report.say(f"  save {i}: blocked {row['blocked_s']:.3f} s, staging {row['staging_s']:.3f} s, allocated "
                   f"{row['allocated_mib']:.0f} MiB, page faults {row['faults']}, modules imported "
                   f"{row['imported_modules']}")  # fmt: skip
    ratio = first_vs_steady([r["blocked_s"] for r in rows])
    result.update(ratio)
    report.say(f"  first {ratio['first_s']:.3f} s, later {ratio['steady_s']:.3f} s (median): {ratio['ratio']:.2f}x "
               "(target <= 1.5)")  # fmt: skip


def run(args: argparse.Namespace, report: Report) -> int:
    """Each scenario asked for in a fresh process, in turn."""
    if args.saves < 2:
        raise SystemExit("benchmarks first_save: --saves must be at least 2 (the first one and a later one)")
    report.say(f"load average {os.getloadavg()[0]:.2f}; {args.mib} MiB in {args.tensors} fp32 tensors, "
               f"{args.saves} saves")  # fmt: skip
    for name in args.sections or list(SECTIONS):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            kwargs = {"scenario": name, "mib": args.mib, "tensors": args.tensors, "saves": args.saves,
                      "directory": directory}  # fmt: skip
            result = report.data[name] = in_child("benchmarks.suites.first_save:scenario", kwargs)
        report_scenario(report, name, result)
    report.say(f"load average {os.getloadavg()[0]:.2f}")
    return 0
