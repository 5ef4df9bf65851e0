"""Today's nxd_ckpt (``--today-ref`` from git, or ``--today-src``) and this tree's, each in a child process of its
own: a first and steady async saves, then saves while training goes on."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time
from typing import Any

from benchmarks.core.child import REPO, in_child
from benchmarks.core.devices import Device, Training, pick_device
from benchmarks.core.files import remove
from benchmarks.core.ranks import single_rank_group
from benchmarks.suites.device.first import first_async
from benchmarks.suites.device.run import say
from benchmarks.suites.device.saves import describe_save, nxd_save

TRAINING_MIN_STEPS = 4


def steady_saves(dev: Device, tr: Training, directory: str, reps: int, who: str) -> list[dict[str, Any]]:
    """``reps`` steady async xser saves, two steps before each."""
    out, path = [], os.path.join(directory, "today")
    for i in range(reps):
        tr.steps(2)
        figures = nxd_save(dev, path, f"s{i}", tr, xser=True, async_save=True)
        remove(os.path.join(path, f"s{i}"))
        out.append(figures)
        say(f"[{who}] steady async save #{i + 1}: {describe_save(figures)}")
    return out


def today_child(
    device: str, hidden: int, layers: int, reps: int, training_saves: int, directory: str, src: str
) -> dict[str, Any]:
    """In the child: the same state, first + ``reps`` steady async xser saves with the nxd_ckpt of ``src``, then
    ``training_saves`` saves while training goes on."""
    import nxd_ckpt

    if not os.path.abspath(nxd_ckpt.__file__).startswith(os.path.abspath(src)):
        raise SystemExit(f"benchmarks device: the child imported nxd_ckpt from {nxd_ckpt.__file__}, not {src}")
    dev = Device(pick_device(device))
    tr = Training(dev, hidden, layers)
    tr.steps(3)
    single_rank_group()
    out: dict[str, Any] = {"nxd_ckpt": os.path.dirname(nxd_ckpt.__file__)}
    out["first"] = first_async(dev, tr, directory)
    who = "today" if os.path.abspath(src) != REPO else "this tree"
    say(f"[{who}] first async save: {describe_save(out['first'])}")
    out["steady"] = steady_saves(dev, tr, directory, reps, who)
    out["training"] = []
    for i in range(training_saves):
        figures = save_while_training(dev, tr, os.path.join(directory, "training"), f"t{i}")
        out["training"].append(figures)
        say(f"[{who}] async save while training goes on #{i + 1}: blocked {figures['call_s']:.3f} s, durable "
            f"{figures['durable_s']:.2f} s, {figures['steps']} steps in {figures['total_s']:.2f} s against "
            f"{figures['step_alone_s']:.3f} s a step alone: training lost {figures['lost_s']:.2f} s")  # fmt: skip
    nxd_ckpt.finalize_checkpoint()
    return out


def step_alone_s(dev: Device, tr: Training) -> float:
    """A step's time without a save in flight: ``TRAINING_MIN_STEPS`` launched back to back, then synced."""
    start = time.perf_counter()
    for _ in range(TRAINING_MIN_STEPS):
        tr.launch_step()
    dev.sync()
    return (time.perf_counter() - start) / TRAINING_MIN_STEPS


def save_while_training(dev: Device, tr: Training, path: str, tag: str) -> dict[str, Any]:
    """An async xser save in a loop that goes on training, as a real one does: steps launched back to back from the
    call's return until the save is durable (at least ``TRAINING_MIN_STEPS``), then the device synced. Times the
    call, durable (``report.wait()`` on a thread), and the loop against the same number of steps without a save,
    timed just before: what the save cost training in all (blocked + slower steps)."""
    import nxd_ckpt as nxd

    alone = step_alone_s(dev, tr)
    durable = threading.Event()
    stamps: dict[str, Any] = {}

    def wait_durable(report: Any) -> None:
        try:
            report.wait()
        except BaseException as e:
            stamps["error"] = repr(e)
        stamps["durable"] = time.perf_counter()
        durable.set()

    start = time.perf_counter()
    report = nxd.save_checkpoint(path, tag, model=tr.model, optimizer=tr.opt, use_xser=True, async_save=True)
    call_s = time.perf_counter() - start
    threading.Thread(target=wait_durable, args=(report,), daemon=True).start()
    steps = 0
    while steps < TRAINING_MIN_STEPS or (not durable.is_set() and steps < 500):
        tr.launch_step()
        steps += 1
    dev.sync()
    total_s = time.perf_counter() - start
    if not durable.wait(600):
        raise RuntimeError(f"the save {tag} was not durable 600 s after its training steps")
    if "error" in stamps:
        raise RuntimeError(f"the save {tag} failed: {stamps['error']}")
    remove(os.path.join(path, tag))
    return {"call_s": call_s, "durable_s": stamps["durable"] - start, "steps": steps, "total_s": total_s,
            "step_alone_s": alone, "lost_s": total_s - steps * alone}  # fmt: skip


def extract_today(ref: str, root: str) -> str | None:
    """``nxd_ckpt`` as of ``ref`` (``git archive``) in a new directory under ``root``; None, said, on failure."""
    src = os.path.join(root, "today_src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", ref, "nxd_ckpt"], capture_output=True,
                             check=False)  # fmt: skip
    if archive.returncode != 0:
        say(f"today: skipped: git archive {ref} failed ({archive.stderr.decode().strip()[:200]}); --today-src DIR "
            "takes an extracted tree")  # fmt: skip
        return None
    subprocess.run(["tar", "-x", "-C", src], input=archive.stdout, check=True)
    say(f"today: nxd_ckpt as of {ref} (git archive), in a child process")
    return src


def run_today(args: argparse.Namespace, kind: str, root: str, src: str | None = None) -> dict[str, Any] | None:
    """The saves of today's nxd_ckpt (--today-src, or --today-ref extracted with git archive) in a child process;
    ``src``: another tree's nxd_ckpt (this one's, for durable times measured the same way as today's)."""
    name = "today" if src is None else "this tree"
    src = src or args.today_src or extract_today(args.today_ref, root)
    if src is None:
        return None
    if not os.path.isdir(os.path.join(src, "nxd_ckpt")):
        say(f"{name}: skipped: {src} holds no nxd_ckpt package")
        return None
    work = os.path.join(root, "today_work")
    os.makedirs(work)
    kwargs = {"device": kind, "hidden": args.hidden, "layers": args.layers, "reps": args.today_saves,
              "training_saves": args.training_saves, "directory": work, "src": src}  # fmt: skip
    try:
        return in_child("benchmarks.suites.device.today:today_child", kwargs, path_first=src)
    except RuntimeError as e:
        say(f"{name}: skipped: {e}")
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
