"""nxd_ckpt's own rows: sync saves (plain and xser) with verified and unverified loads into fresh dicts and into
the live module, the async save (with its blocked time against a memcpy of the same bytes), and a sync save that
deletes the previous tag by retention."""

from __future__ import annotations

import os
import shutil
import time

import torch.distributed as dist

from benchmarks.core.baselines import aligned_views, copy_into
from benchmarks.core.ranks import slowest
from benchmarks.core.state import assert_same, tensors_of, to_xla
from benchmarks.suites.saveload.bench import Bench, Timing, check_live, live, section, with_peak

_ON_XLA: dict[str, tuple[dict, dict]] = {}


def on_xla(b: Bench) -> tuple[dict, dict]:
    """The state moved to the XLA device once per process (as it lives there during training)."""
    if "xla" not in _ON_XLA:
        _ON_XLA["xla"] = to_xla(b.model, b.optimizer)
    return _ON_XLA["xla"]


def memcpy_s(b: Bench) -> float:
    """Slowest rank's time to copy the bytes it saves into an already-allocated, already-touched host buffer."""
    saved = (tensors_of(b.model) if b.rank == 0 else []) + tensors_of(b.optimizer)  # DP rank 0 saves the model
    views = aligned_views(saved)
    dist.barrier()
    return slowest(copy_into(saved, views))


@section("nxd_async", "nxd_ckpt async_save=True plain (save = until durable and committed), load(verify=False)")
def nxd_async(b: Bench) -> Timing:
    """Also times the call alone (blocked) and a memcpy of this rank's saved bytes (its target)."""
    import nxd_ckpt as nxd

    path = b.path("nxd_async")
    memcpy = memcpy_s(b)
    figures: dict[str, float] = {}

    def save() -> None:
        start = time.perf_counter()
        report = nxd.save_checkpoint(
            path, "step_1", model=b.model, optimizer=b.optimizer, zero1_optimizer=True, async_save=True
        )
        figures["blocked_s"], figures["staging_s"] = time.perf_counter() - start, report.staging_s
        report.wait()  # rank 0: 'done' written; other ranks: the commit outcome is known

    model_out: dict = {}
    optim_out: dict = {}
    save_s = b.timed(save)
    extra = {k: slowest(v) for k, v in figures.items()} | {"memcpy_s": memcpy}

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=model_out, optimizer=optim_out, verify=False)

    timing = Timing(save_s, b.timed_load(load), extra)
    if b.check:
        assert_same(b.model, model_out, "nxd_async model")
        assert_same(b.optimizer, optim_out, "nxd_async optimizer")
    b.clean("nxd_async")
    return timing


def fresh_dicts(b: Bench, name: str, *, use_xser: bool, verify: bool, device: str | None = None) -> Timing:
    """A sync save (of the state on ``device`` when given), then a cold load into fresh dicts."""
    import nxd_ckpt as nxd

    model, optimizer = on_xla(b) if device == "xla" else (b.model, b.optimizer)
    path = b.path(name)
    model_out: dict = {}
    optim_out: dict = {}

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=model, optimizer=optimizer, use_xser=use_xser, zero1_optimizer=True)

    def load() -> None:
        nxd.load_checkpoint(path, "step_1", model=model_out, optimizer=optim_out, verify=verify)

    timing = Timing(b.timed(save), b.timed_load(load))
    if b.check:
        assert_same(b.model, model_out, f"{name} model")
        assert_same(b.optimizer, optim_out, f"{name} optimizer")
    model_out.clear()
    optim_out.clear()
    b.clean(name)
    return timing


@section("nxd_xser", "nxd_ckpt use_xser=True (defaults: checksums written and verified)")
def nxd_xser(b: Bench) -> Timing:
    """xser save, verified load."""
    return fresh_dicts(b, "nxd_xser", use_xser=True, verify=True)


@section("nxd_xser_noverify", "nxd_ckpt use_xser=True, load(verify=False)")
def nxd_xser_noverify(b: Bench) -> Timing:
    """xser save, unverified load."""
    return fresh_dicts(b, "nxd_xser_nv", use_xser=True, verify=False)


@section("nxd_plain", "nxd_ckpt plain (one torch.save file per state file), load(verify=False)")
def nxd_plain(b: Bench) -> Timing:
    """Plain save, unverified load."""
    return fresh_dicts(b, "nxd_plain", use_xser=False, verify=False)


def live_load(b: Bench, name: str, *, use_xser: bool = True, device: str | None = None) -> Timing:
    """A sync save, then a verified cold load into the live module (and the optimizer shard into {}), with the
    load's peak host memory."""
    import nxd_ckpt as nxd

    model, optimizer = on_xla(b) if device == "xla" else (b.model, b.optimizer)
    path = b.path(name)

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=model, optimizer=optimizer, use_xser=use_xser, zero1_optimizer=True)

    module = live(b, device)
    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(lambda: nxd.load_checkpoint(path, "step_1", model=module, optimizer={}))
    timing = with_peak(b, Timing(save_s, load_s), peak)
    check_live(b, module, f"{name} live model")
    b.clean(name)
    return timing


@section("nxd_xser_live", "nxd_ckpt use_xser=True, verified load into the live module (optimizer into {})")
def nxd_xser_live(b: Bench) -> Timing:
    """xser save; verified load into the live module."""
    return live_load(b, "nxd_xser_live")


@section("nxd_xser_fresh", "nxd_ckpt use_xser=True, verified load into fresh dicts (peak RSS measured)")
def nxd_xser_fresh(b: Bench) -> Timing:
    """xser save; verified load into fresh dicts, with its peak host memory."""
    import nxd_ckpt as nxd

    path = b.path("nxd_xser_fresh")
    out: dict = {}

    def save() -> None:
        nxd.save_checkpoint(path, "step_1", model=b.model, optimizer=b.optimizer, use_xser=True, zero1_optimizer=True)

    def load() -> None:
        out["model"], out["optim"] = {}, {}
        nxd.load_checkpoint(path, "step_1", model=out["model"], optimizer=out["optim"])

    save_s = b.timed(save)
    load_s, peak = b.timed_load_then_peak(load, reset=out.clear)
    timing = with_peak(b, Timing(save_s, load_s), peak)
    if b.check:
        assert_same(b.model, out["model"], "nxd_xser_fresh model")
    out.clear()
    b.clean("nxd_xser_fresh")
    return timing


@section("nxd_plain_verified", "nxd_ckpt plain, verified load into fresh dicts")
def nxd_plain_verified(b: Bench) -> Timing:
    """Plain save; verified load into fresh dicts (compare: torch_save's torch.load)."""
    return fresh_dicts(b, "nxd_plain_v", use_xser=False, verify=True)


@section("nxd_plain_live", "nxd_ckpt plain, verified load into the live module (optimizer into {})")
def nxd_plain_live(b: Bench) -> Timing:
    """Plain save; verified load into the live module (compare: torch_load_live)."""
    return live_load(b, "nxd_plain_live", use_xser=False)


def save_over_a_tag(b: Bench, name: str, keep: bool) -> Timing:
    """A synchronous xser save over an existing tag; with ``keep`` the previous tag is deleted by retention
    (num_kept_ckpts=1), without it the previous tag is deleted after the timing."""
    import nxd_ckpt as nxd

    path = b.path(name)
    kw = {"model": b.model, "optimizer": b.optimizer, "use_xser": True, "zero1_optimizer": True}
    nxd.save_checkpoint(path, "old", **kw)
    dist.barrier()
    save_s = b.timed(lambda: nxd.save_checkpoint(path, "new", num_kept_ckpts=1 if keep else None, **kw))
    nxd.finalize_checkpoint()  # untimed: retention's deletions finish before the next section
    if b.rank == 0 and not keep:
        shutil.rmtree(os.path.join(path, "old"), ignore_errors=True)
    b.clean(name)
    return Timing(save_s, None)


@section("nxd_save_keep", "nxd_ckpt sync xser save, num_kept_ckpts=1 (deletes the previous tag)")
def nxd_save_keep(b: Bench) -> Timing:
    """A sync save whose retention deletes the previous tag."""
    return save_over_a_tag(b, "nxd_keep", keep=True)


@section("nxd_save_nokeep", "nxd_ckpt sync xser save, no retention")
def nxd_save_nokeep(b: Bench) -> Timing:
    """The same save without retention."""
    return save_over_a_tag(b, "nxd_nokeep", keep=False)
