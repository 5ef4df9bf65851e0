"""The first async save of a process against the later ones: where its one-time cost goes.

Each scenario runs in a fresh process (one rank, no process group) holding ``--mib`` of CPU state in ``--tensors``
fp32 tensors (half "model", half "optimizer"), updated in place before each of ``--saves`` async saves:

  finalize     ``finalize_checkpoint()`` after every save (the staging pool is freed each time)
  keep         no finalize between saves (later saves refill the pool's buffers)
  prepared     ``prepare_async_save`` before the first save, waited for (its buffers faulted in beforehand)

Per save it prints the time of the ``nxd.save_checkpoint(...)`` call as a training loop makes it (attribute
access included: whatever nxd_ckpt still imports then is paid there), the staging time, the bytes the staging
newly allocated, the page faults the process took during the call (``ru_minflt``: fresh memory costs one per
4 KiB page, memory glibc hands back from an earlier free costs none) and the modules the call imported. Per
scenario: first / median of the later saves; ``import nxd_ckpt`` (after torch) and the load average are printed
apart.

    python scripts/bench_first_save.py                     # 576 MiB in 36 tensors, 5 saves, all scenarios
    python scripts/bench_first_save.py --mib 1536 --scenarios keep --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SCENARIOS = ("finalize", "keep", "prepared")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(scenario: str, mib: int, tensors: int, saves: int, directory: str) -> dict[str, Any]:
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
        faults, modules = _faults(), set(sys.modules)
        call = time.perf_counter()
        report = nxd.save_checkpoint(
            directory, f"step_{i}", model=model, optimizer=optimizer, async_save=True, num_kept_ckpts=2
        )
        blocked = time.perf_counter() - call
        rows.append(
            {
                "blocked_s": blocked,
                "staging_s": report.staging_s,
                "allocated_mib": report.staging_allocated_bytes / 2**20,
                "faults": _faults() - faults,
                "imported_modules": len(set(sys.modules) - modules),
            }
        )
        report.wait()
        if scenario == "finalize":
            nxd.finalize_checkpoint()
        else:
            nxd.get_manager().wait_pending()  # retention too: the next save waits for nothing
    nxd.finalize_checkpoint()
    return {"import_s": import_s, "saves": rows}


def run_scenario(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        command = [sys.executable, __file__, "--child", scenario, "--mib", str(args.mib)]
        command += ["--tensors", str(args.tensors), "--saves", str(args.saves), "--dir", directory]
        out = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=576, help="MiB of CPU state (default 576)")
    parser.add_argument("--tensors", type=int, default=36, help="number of fp32 tensors (default 36)")
    parser.add_argument("--saves", type=int, default=5, help="async saves per scenario (default 5)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: the temp directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mib, args.tensors, args.saves, args.dir)))
        return 0
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first one and a later one)")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.mib} MiB in {args.tensors} fp32 tensors, {args.saves} saves")
    results = {}
    for scenario in args.scenarios:
        result = results[scenario] = run_scenario(args, scenario)
        rows = result["saves"]
        print(f"{scenario}: import nxd_ckpt (after torch) {result['import_s'] * 1e3:.0f} ms")
        for i, row in enumerate(rows):
            print(f"  save {i}: blocked {row['blocked_s']:.3f} s, staging {row['staging_s']:.3f} s, allocated "
                  f"{row['allocated_mib']:.0f} MiB, page faults {row['faults']}, modules imported "
                  f"{row['imported_modules']}")  # fmt: skip
        first, steady = rows[0]["blocked_s"], statistics.median(r["blocked_s"] for r in rows[1:])
        result["first_s"], result["steady_s"], result["ratio"] = first, steady, first / steady
        print(f"  first {first:.3f} s, later {steady:.3f} s (median): {first / steady:.2f}x (target <= 1.5)")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
