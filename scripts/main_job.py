"""The main job: train on 2 processes, crash mid-run, resume from the latest checkpoint, prove it continued exactly.

Runs examples/train.py three times with torchrun: an uninterrupted reference run, a run that is SIGKILLed right
after handing a checkpoint to the background writer, and a run that resumes from the latest complete checkpoint.
Exits 0 only if every loss after the resume point equals the reference run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(args: list[str], nproc: int, extra_env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(ROOT, "examples", "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    return subprocess.call(cmd, env=env)


def read_losses(path: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--crash-at-step", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    ap.add_argument("--workdir", default=None, help="keep checkpoints and logs here (default: a temp dir)")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="nxd_ckpt_main_job_")
    os.makedirs(work, exist_ok=True)
    env = {"PJRT_DEVICE": "CPU"} if args.device == "xla" else {}
    common = ["--steps", str(args.steps), "--save-every", str(args.save_every), "--device", args.device]

    print(f"== 1/3 reference run: {args.steps} steps without interruption ({args.nproc} processes)", flush=True)
    ref_dir, ref_log = os.path.join(work, "ref_ckpt"), os.path.join(work, "ref_losses.jsonl")
    shutil.rmtree(ref_dir, ignore_errors=True)
    if os.path.exists(ref_log):
        os.remove(ref_log)
    if torchrun([*common, "--ckpt-dir", ref_dir, "--loss-log", ref_log], args.nproc, env) != 0:
        print("reference run failed", file=sys.stderr)
        return 1

    print(f"== 2/3 crashing run: killed with SIGKILL at step {args.crash_at_step}", flush=True)
    ckpt, log = os.path.join(work, "ckpt"), os.path.join(work, "losses.jsonl")
    shutil.rmtree(ckpt, ignore_errors=True)
    if os.path.exists(log):
        os.remove(log)
    rc = torchrun(
        [*common, "--ckpt-dir", ckpt, "--loss-log", log, "--crash-at-step", str(args.crash_at_step)],
        args.nproc,
        env,
    )
    print(f"   crashing run exited with code {rc} (non-zero expected)", flush=True)
    sys.path.insert(0, ROOT)
    import nxd_ckpt as nxd

    latest = nxd.latest_checkpoint_tag(ckpt)
    print(
        f"   complete checkpoints after the crash: {nxd.list_checkpoint_tags(ckpt)}; latest: {latest}",
        flush=True,
    )
    if latest is None:
        print("no complete checkpoint survived the crash", file=sys.stderr)
        return 1
    resume_step = int(latest.split("_")[-1])

    print(f"== 3/3 resumed run: from {latest} to step {args.steps}", flush=True)
    resumed_log = os.path.join(work, "resumed_losses.jsonl")
    if os.path.exists(resumed_log):
        os.remove(resumed_log)
    if torchrun([*common, "--ckpt-dir", ckpt, "--loss-log", resumed_log], args.nproc, env) != 0:
        print("resumed run failed", file=sys.stderr)
        return 1

    ref, resumed = read_losses(ref_log), read_losses(resumed_log)
    steps = list(range(resume_step + 1, args.steps + 1))
    mismatches = [s for s in steps if resumed.get(s) != ref.get(s)]
    print(f"\n{'step':>5} {'uninterrupted loss':>20} {'resumed loss':>20}")
    for s in steps:
        mark = "" if s not in mismatches else "   <-- differs"
        print(f"{s:>5} {ref[s]:>20.10f} {resumed.get(s, float('nan')):>20.10f}{mark}")
    if mismatches or set(resumed) != set(steps):
        print(f"\nFAIL: the resumed run differs at steps {mismatches or sorted(set(steps) ^ set(resumed))}")
        return 1
    print(
        f"\nOK: resumed from {latest} after a crash at step {args.crash_at_step}; all {len(steps)} losses after "
        f"the resume point equal the uninterrupted run's bit for bit. Work dir: {work}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
