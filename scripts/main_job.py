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


def torchrun(args: list[str], nproc: int, extra_env: dict[str, str], stderr_path: str | None = None) -> int:
    """Run examples/train.py under torchrun; with ``stderr_path``, torchrun's stderr goes to that file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(ROOT, "examples", "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    if stderr_path is None:
        return subprocess.call(cmd, env=env)
    with open(stderr_path, "w") as err:
        return subprocess.call(cmd, env=env, stderr=err)


def killed_by_sigkill(stderr_text: str) -> bool:
    """Whether torchrun's report says its workers died of SIGKILL (exit code -9), i.e. the planned crash."""
    return "exitcode: -9" in stderr_text or "Signal 9 (SIGKILL)" in stderr_text


def describe_files(ckpt_dir: str, tag: str) -> str:
    """What the files of a tag really are: xser writes tensors under 64 KiB inline, so a small model's "xser"
    checkpoint has no per-tensor files at all."""
    from nxd_ckpt.inspection import open_checkpoint

    ckpt = open_checkpoint(ckpt_dir, tag)
    state_files = ckpt.state_files()
    xser = [s for s in state_files if s.encoding == "xser"]
    if xser:
        return f"{len(state_files)} state files, {len(xser)} of them xser (one file per tensor)"
    return (
        f"{len(state_files)} state files, all single torch.save-readable files: xser was asked for, but every "
        "tensor is under NXD_CKPT_XSER_INLINE_BYTES (64 KiB) and stays inline"
    )


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
    if args.workdir:
        print(f"work dir: {work} (kept)", flush=True)
    else:
        print(f"work dir: {work} (removed at the end if the job succeeds; --workdir DIR keeps it)", flush=True)
    status = run(args, work)
    if status == 0 and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed the work dir {work}")
    elif status != 0:
        print(f"kept the work dir for inspection: {work}", file=sys.stderr)
    return status


def run(args: argparse.Namespace, work: str) -> int:
    """The three runs and the comparison; 0 when every loss after the resume point matches."""
    env = {"PJRT_DEVICE": "CPU"} if args.device == "xla" else {}
    env["TMPDIR"] = os.path.join(work, "tmp")  # torchrun's log directories go with the work dir, not into /tmp
    os.makedirs(env["TMPDIR"], exist_ok=True)
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
    crash_report = os.path.join(work, "crashing_run.stderr")
    rc = torchrun(
        [*common, "--ckpt-dir", ckpt, "--loss-log", log, "--crash-at-step", str(args.crash_at_step)],
        args.nproc,
        env,
        stderr_path=crash_report,
    )
    with open(crash_report) as f:
        report = f.read()
    if rc == 0 or not killed_by_sigkill(report):
        print(f"the crashing run did not end with the planned SIGKILL (exit code {rc}); its stderr:", file=sys.stderr)
        print(report, file=sys.stderr)
        return 1
    print(
        f"   the training processes were SIGKILLed at step {args.crash_at_step} as planned: the simulated node "
        "failure, not an error (torchrun's report of it, 'failed (exitcode: -9)' and a ChildFailedError, goes to "
        "crashing_run.stderr in the work dir)",
        flush=True,
    )
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
    print(f"   {latest}: {describe_files(ckpt, latest)}", flush=True)

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
        f"the resume point equal the uninterrupted run's bit for bit."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
