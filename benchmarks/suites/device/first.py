"""First async saves: the process's own (nothing touched checkpointing before), and in fresh child processes: plain,
after ``prepare_async_save``, and after a resume (prepared by the load, and with NXD_CKPT_PREPARE_ON_RESUME=0)."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

from benchmarks.core.child import in_child
from benchmarks.core.devices import Device, Training, pick_device
from benchmarks.core.files import remove
from benchmarks.core.memory import PeakRSS
from benchmarks.core.ranks import single_rank_group
from benchmarks.suites.device.run import say
from benchmarks.suites.device.saves import describe_save, nxd_save


def first_async(dev: Device, tr: Training, root: str) -> dict[str, Any]:
    """The process's first async save (nothing touched checkpointing before), with its resident-memory growth."""
    import nxd_ckpt as nxd

    nxd.save_checkpoint  # noqa: B018 - resolved (imported) before the timing, as a training script does at its start
    path = os.path.join(root, "first")
    peak = PeakRSS(sample=False)
    with peak:
        figures = nxd_save(dev, path, "first", tr, xser=True, async_save=True)
    figures |= {"first_host_rss": peak.extra_rss}
    remove(path)
    return figures


def resume_then_train(dev: Device, tr: Training, resume_dir: str, prepare_on_resume: bool) -> dict[str, Any]:
    """``load_checkpoint`` of the async-saved tag in ``resume_dir`` (which prepares the next async save, unless
    NXD_CKPT_PREPARE_ON_RESUME=0), timed with its graph compiles, then 3 steps."""
    import nxd_ckpt as nxd

    single_rank_group()
    if not prepare_on_resume:
        os.environ["NXD_CKPT_PREPARE_ON_RESUME"] = "0"
    compiles, start = dev.compiles(), time.perf_counter()
    nxd.load_checkpoint(resume_dir, model=tr.model, optimizer=tr.opt)
    out = {"load_s": time.perf_counter() - start, "load_compiles": dev.compiles() - compiles}
    tr.steps(3)
    return out


def first_child(
    device: str, hidden: int, layers: int, directory: str, resume_dir: str, prepare: bool = False,
    resume: str | None = None, write_resume_tag: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """In a fresh child: the state, 3 steps, the process group, then the process's first async save; its figures.
    Before the save, ``prepare``: ``prepare_async_save``; ``resume`` on|off: instead of the steps, a resume
    (``resume_then_train``); ``write_resume_tag``: only that tag's async save (into ``resume_dir``), no figures."""
    import nxd_ckpt as nxd

    dev = Device(pick_device(device))
    tr = Training(dev, hidden, layers)
    out: dict[str, Any] = {}
    if resume:
        out |= resume_then_train(dev, tr, resume_dir, prepare_on_resume=resume == "on")
    else:
        tr.steps(3)
        single_rank_group()
    if write_resume_tag:
        nxd.save_checkpoint(resume_dir, "resume", model=tr.model, optimizer=tr.opt, use_xser=True, async_save=True)
        nxd.finalize_checkpoint()
        return {}
    if prepare:
        compiles, start = dev.compiles(), time.perf_counter()
        nxd.prepare_async_save(model=tr.model, optimizer=tr.opt, use_xser=True)
        out["prepare_s"] = time.perf_counter() - start
        out["prepare_compiles"] = dev.compiles() - compiles
    out["first"] = first_async(dev, tr, directory)
    nxd.finalize_checkpoint()
    return out


FIRST_KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "plain": ({}, ""),
    "prepared": ({"prepare": True}, "after prepare_async_save"),
    "resumed": ({"resume": "on"}, "after a resume of an async-saved tag"),
    "resumed_off": ({"resume": "off"}, "after a resume with NXD_CKPT_PREPARE_ON_RESUME=0"),
}
TARGET = "benchmarks.suites.device.first:first_child"


def resumable_kinds(args: argparse.Namespace, common: dict[str, Any], root: str, resume_dir: str) -> list[str]:
    """The kinds of first save this run makes: the resumed ones only where a child could write the async-saved
    tag they load (and this nxd_ckpt can prepare)."""
    import nxd_ckpt

    if "resume" not in args.rows or not hasattr(nxd_ckpt, "prepare_async_save"):
        return ["plain", "prepared"]
    try:
        in_child(TARGET, {**common, "directory": root, "resume_dir": resume_dir, "write_resume_tag": True})
    except RuntimeError as e:
        say(f"the tag the resumed first saves load: FAILED ({e}); no resumed first saves")
        return ["plain", "prepared"]
    return list(FIRST_KINDS)


def one_first_child(common: dict[str, Any], name: str, work: str, resume_dir: str, i: int) -> dict | None:
    """One fresh process's first save of kind ``name``, said; None when the child failed."""
    flags, what = FIRST_KINDS[name]
    os.makedirs(work)
    try:
        figures = in_child(TARGET, {**common, "directory": work, "resume_dir": resume_dir, **flags})
    except RuntimeError as e:
        say(f"first save in a fresh process {what}: FAILED ({e})")
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "prepare_s" in figures:
        what += f" ({figures['prepare_s']:.3f} s, {figures['prepare_compiles']} compiles)"
    if "load_s" in figures:
        what += f" (load {figures['load_s']:.3f} s, {figures['load_compiles']} compiles)"
    say(f"[fresh process {i + 1}] first async save {what} (xser): {describe_save(figures['first'])}")
    return figures


def run_first_children(args: argparse.Namespace, kind: str, root: str) -> dict[str, list[dict]]:
    """--first-runs fresh processes of each kind of first save (``FIRST_KINDS``), alternating; the resumed ones
    load a tag one more child saved asynchronously first (with this nxd_ckpt, where it can resume)."""
    common = {"device": kind, "hidden": args.hidden, "layers": args.layers}
    resume_dir = os.path.join(root, "resume_tag")
    kinds = resumable_kinds(args, common, root, resume_dir) if args.first_runs else []
    samples: dict[str, list[dict]] = {k: [] for k in FIRST_KINDS}
    for i in range(args.first_runs):
        for name in kinds:
            figures = one_first_child(common, name, os.path.join(root, f"first_work_{i}"), resume_dir, i)
            if figures is not None:
                samples[name].append(figures)
    shutil.rmtree(resume_dir, ignore_errors=True)
    return samples
