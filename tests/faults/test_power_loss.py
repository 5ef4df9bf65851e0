"""Power loss during saves: a FUSE layer journals every fsync, and each cut point rebuilds what a power cut there
leaves (only fsynced file data, only directory entries whose directory was fsynced; see harness/powerloss.py).

After every cut: each tag that has ``done`` verifies and loads bit-exactly (model, optimizer, user content) as one
of the versions saved under that name, the newest one loads through ``load_checkpoint`` without a tag, and every
save that had returned (journaled as a mark) is still there. Scenarios: 2-rank sync and async saves, plain and
xser, with retention, ZeRO-1 shards, the offline ZeRO-1 converter, and re-saves of a complete tag.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

import pytest
import torch

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from harness.powerloss import MARK_PREFIX, CrashJournal, fuse_unavailable_reason, mounted
from nxd_ckpt.format import tags
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal
from nxd_ckpt.tools.convert_zero1 import convert_zero1

_REASON = fuse_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason=_REASON or ""),
    pytest.mark.timeout(600),
    pytest.mark.device_independent,
]

WORLD = 2
CUT_POINTS: dict[str, int] = {}


def _require_fuse() -> None:
    if _REASON is not None and os.path.exists("/dev/fuse"):  # /dev/fuse is there: the set-up must provide the rest
        pytest.fail(_REASON)


# --------------------------------------------------------------------------------------------- expected states


def _t(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def model_state(step: int, version: int = 0) -> dict[str, torch.Tensor]:
    s = 1000 * version + 10 * step
    return {"w": _t(s, 8, 6), "b": _t(s + 1, 6), "head": _t(s + 2, 6, 4).to(torch.bfloat16)}


def optimizer_state(step: int, version: int = 0) -> dict[str, Any]:
    s = 1000 * version + 10 * step + 5
    state = {i: {"step": torch.tensor(float(step)), "exp_avg": _t(s + i, 8, 6)} for i in range(2)}
    return {"state": state, "param_groups": [{"lr": 0.01, "params": [0, 1]}]}


ZERO1_SHAPES = {0: (8, 3), 1: (4,)}


def zero1_full_state(step: int) -> dict[str, Any]:
    """torch_xla ZeroRedundancyOptimizer layout; dim 0 divides by 2, so the DP=2 shards need no padding."""
    return {
        "state": {},
        "param_groups": [{"lr": 0.01, "params": list(ZERO1_SHAPES)}],
        "base_state": {
            i: {"step": torch.tensor(float(step)), "exp_avg": _t(100 * step + i, *s), "exp_avg_sq": _t(7 + i, *s)}
            for i, s in ZERO1_SHAPES.items()
        },
        "shape_info": {i: torch.Size(s) for i, s in ZERO1_SHAPES.items()},
        "sharded_master_weights": {i: _t(50 * step + i, *s) for i, s in ZERO1_SHAPES.items()},
    }


def zero1_shard(full: dict[str, Any], dp: int, rank: int) -> dict[str, Any]:
    out = dict(full)
    out["base_state"] = {
        i: {k: (v.clone() if k == "step" else v.chunk(dp)[rank].clone()) for k, v in per.items()}
        for i, per in full["base_state"].items()
    }
    out["sharded_master_weights"] = {i: v.chunk(dp)[rank].clone() for i, v in full["sharded_master_weights"].items()}
    return out


def user_content(step: int, version: int = 0) -> dict[str, int]:
    return {"step": step, "version": version}


def expected_optimizer(step: int, version: int, zero1: bool) -> dict[str, Any]:
    """What a one-process load returns (ZeRO-1: the DP=1 'shard', i.e. the whole state)."""
    return zero1_full_state(step) if zero1 else optimizer_state(step, version)


# --------------------------------------------------------------------------------------------- ranks


def _mark(mnt: str, label: str) -> None:
    os.path.exists(os.path.join(mnt, MARK_PREFIX + label))  # journaled by the FUSE server (PowerLossMount.mark)


def _save_steps(mnt: str, saves: list[tuple[int, int]], options: dict[str, Any]) -> None:
    """Each rank: save (step, version) in order; rank 0 marks each save once it returned (async: committed)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    zero1 = options.get("zero1_optimizer", False)
    for step, version in saves:
        optimizer = zero1_shard(zero1_full_state(step), WORLD, rank) if zero1 else optimizer_state(step, version)
        report = nxd.save_checkpoint(
            mnt,
            f"step_{step}",
            model=model_state(step, version),
            optimizer=optimizer,
            user_content=user_content(step, version),
            **options,
        )
        report.wait()
        if rank == 0:
            _mark(mnt, f"saved-step_{step}-v{version}")
    nxd.finalize_checkpoint()
    dist.barrier()


# --------------------------------------------------------------------------------------------- checks


def _tree_fingerprint(root: str, extra: object = ()) -> str:
    """Every file's path and bytes under ``root`` (and ``extra``): equal fingerprints, equal checks."""
    digest = hashlib.sha256(repr(extra).encode())
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        digest.update(os.path.relpath(dirpath, root).encode() + b"\0")
        for name in sorted(files):
            with open(os.path.join(dirpath, name), "rb") as f:
                digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


class CrashChecker:
    """Checks post-crash states of one scenario; a tag directory identical to one already checked (same files,
    same bytes) is not verified and loaded again, and neither is an identical whole state."""

    def __init__(self, order: list[tuple[str, int]], zero1: bool, what: str) -> None:
        self.order = order  # (tag, version) in the order they were saved (or converted)
        self.zero1 = zero1
        self.what = what
        self.tag_versions: dict[str, int] = {}
        self.states: set[str] = set()

    def check(self, root: str, journal: CrashJournal, cut: int, model: str) -> None:
        saved = [label for label in journal.marks_before(cut) if label.startswith("saved-")]
        fingerprint = _tree_fingerprint(root, saved)
        if fingerprint in self.states:
            return
        where = f"{self.what}, {model} model, cut {cut} {journal.describe(cut)}"
        complete = nxd.list_checkpoint_tags(root)
        versions = {tag: self._check_tag(root, tag, where) for tag in complete}
        if saved:  # every save that returned survives: its tag (or a newer one) is complete, at that version
            last_tag, last_version = saved[-1].removeprefix("saved-").rsplit("-v", 1)
            position = self.order.index((last_tag, int(last_version)))
            survivors = [i for i, (tag, v) in enumerate(self.order) if versions.get(tag) == v]
            assert survivors and max(survivors) >= position, (
                f"{where}: the save of {last_tag} v{last_version} had returned, but the complete tags are "
                f"{ {t: f'v{v}' for t, v in versions.items()} }"
            )
        if complete:  # and the newest loads without naming it
            assert nxd.load_checkpoint(root, model={})["step"] == int(complete[-1].split("_")[1]), where
        self.states.add(fingerprint)

    def _check_tag(self, root: str, tag: str, where: str) -> int:
        """A tag with 'done': it verifies and loads bit-exactly as one of the versions saved under its name."""
        key = tag + ":" + _tree_fingerprint(os.path.join(root, tag))
        if key in self.tag_versions:
            return self.tag_versions[key]
        report = nxd.verify(root, tag)
        assert report.ok, f"{where}: {tag} has 'done' but fails verification: {report.summary()}"
        model: dict = {}
        optimizer: dict = {}
        content = nxd.load_checkpoint(root, tag, model=model, optimizer=optimizer)
        step, version = content["step"], content["version"]
        assert (tag, version) in self.order, f"{where}: {tag} holds {content}"
        assert tag == f"step_{step}" or tag.endswith("_conv"), f"{where}: {tag} holds {content}"
        assert_state_equal(model, model_state(step, version), f"{where}: {tag} model")
        assert_state_equal(optimizer, expected_optimizer(step, version, self.zero1), f"{where}: {tag} optimizer")
        self.tag_versions[key] = version
        return version


def check_all_cuts(base: str, journal: CrashJournal, order: list[tuple[str, int]], zero1: bool, what: str) -> int:
    """Check the state after every cut point of both crash models; return the number of cut points."""
    checker = CrashChecker(order, zero1, what)
    cuts = 0
    for model, points, materialize in (
        ("strict", journal.cut_points(), journal.materialize),
        ("ordered", journal.ordered_cut_points(), journal.materialize_ordered),
    ):
        for cut in points:
            dest = os.path.join(base, f"{model}_{cut}")
            materialize(cut, dest)
            checker.check(dest, journal, cut, model)
            shutil.rmtree(dest)
        cuts += len(points)
    CUT_POINTS[what] = cuts
    print(f"\n[power loss] {what}: {cuts} cut points, {len(checker.states)} distinct post-crash states checked")
    return cuts


# --------------------------------------------------------------------------------------------- scenarios


SAVE_SCENARIOS = {
    "sync-plain-retention": dict(async_save=False, use_xser=False, num_kept_ckpts=2),
    "async-plain-retention": dict(async_save=True, use_xser=False, num_kept_ckpts=2),
    "sync-xser-retention": dict(async_save=False, use_xser=True, num_kept_ckpts=2),
    "async-xser": dict(async_save=True, use_xser=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAVE_SCENARIOS))
def test_power_loss_during_saves(tmp_path, name):
    _require_fuse()
    options = SAVE_SCENARIOS[name]
    saves = [(1, 0), (2, 0), (3, 0)]
    with mounted(str(tmp_path)) as m:
        run_on_ranks(_save_steps, WORLD, {"mnt": m.mountpoint, "saves": saves, "options": options}, timeout=300)
        journal = m.journal()
    assert journal.marks_before(len(journal.sequence))[-1] == "saved-step_3-v0"
    order = [(f"step_{s}", v) for s, v in saves]
    assert check_all_cuts(str(tmp_path), journal, order, zero1=False, what=name) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_power_loss_during_resave_of_a_complete_tag(tmp_path, async_save):
    """step_1 is complete; saving step_1 again (new contents) must keep the old one loadable until the new one is."""
    _require_fuse()
    saves = [(1, 0), (1, 1), (1, 2)]
    options = dict(async_save=async_save, use_xser=async_save)
    with mounted(str(tmp_path)) as m:
        run_on_ranks(_save_steps, WORLD, {"mnt": m.mountpoint, "saves": saves, "options": options}, timeout=300)
        journal = m.journal()
    order = [(f"step_{s}", v) for s, v in saves]
    what = f"resave-{'async' if async_save else 'sync'}"
    assert check_all_cuts(str(tmp_path), journal, order, zero1=False, what=what) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_power_loss_during_zero1_save_and_conversion(tmp_path, use_xser):
    """ZeRO-1 shards saved by 2 ranks, then the offline converter writes a full-optimizer tag beside them."""
    _require_fuse()
    options = dict(zero1_optimizer=True, use_xser=use_xser)
    with mounted(str(tmp_path)) as m:
        run_on_ranks(_save_steps, WORLD, {"mnt": m.mountpoint, "saves": [(4, 0)], "options": options}, timeout=300)
        convert_zero1(
            os.path.join(m.mountpoint, "step_4"), os.path.join(m.mountpoint, "step_4_conv"), convert_to_full=True
        )
        m.mark("saved-step_4_conv-v0")
        journal = m.journal()
    what = f"zero1-convert-{'xser' if use_xser else 'plain'}"
    order = [("step_4", 0), ("step_4_conv", 0)]
    assert check_all_cuts(str(tmp_path), journal, order, zero1=True, what=what) >= 10
    # The last cut is the finished state: both tags there, the converted one holding full optimizer files.
    final = os.path.join(str(tmp_path), "final")
    journal.materialize(len(journal.sequence), final)
    assert [t.name for t in tags.list_tags(LocalStorage(final))] == ["step_4", "step_4_conv"]
