"""The read plan as a value: ``plan_read`` and ``files_read`` are pure functions of a tag's description and the
job's layout, so every rank's plan is built here in one process, for a made-up tag, with no storage at all."""

from __future__ import annotations

import dataclasses

import pytest

from nxd_ckpt.errors import LayoutMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.format.metadata import metadata_path
from nxd_ckpt.load.read_plan import ReadPlan, changes_layout, files_read, plan_read
from nxd_ckpt.ranks.topology import Topology

TAG = "step5"


def _saved(
    tp: int = 2, dp: int = 2, *, zero1: bool = False, zero1_dp: int | None = None, full: bool = False,
    xser: bool = False, ep: int = 1,
) -> TagDescription:  # fmt: skip
    """A tag saved at TP=``tp`` PP=1 DP=``dp`` (ZeRO-1 shards for ``zero1_dp`` ranks, or merged ``full``)."""
    return TagDescription(
        tag=TAG, tp=tp, pp=1, dp=None if full else (zero1_dp or dp), world_size=tp * dp, zero1=zero1 or full,
        zero1_dp_size=None if full else zero1_dp, zero1_full=full, xser=xser, items=("model", "optimizer"),
        present_items=("model", "optimizer"), metadata=None, ep=ep,
    )  # fmt: skip


def _plans(info: TagDescription, sizes: dict[str, int], **targets: object) -> list[ReadPlan]:
    """Every rank's plan in a job of ``sizes`` (``Topology``'s keyword arguments, without the rank)."""
    kwargs: dict = {"model": True, "optimizer": True, "scheduler": False, "num_workers": 1, **targets}
    world = Topology(**sizes).world_size
    return [plan_read(TAG, info, Topology(**sizes, rank=r), url="mem://ckpt", **kwargs) for r in range(world)]


def test_same_layout_each_rank_reads_its_coordinates_files():
    plans = _plans(_saved(), {"tp_size": 2, "dp_size": 2})  # rank = dp * 2 + tp (row-major)
    assert [p.model for p in plans] == [layout.model_file(TAG, r % 2, 0) for r in range(4)]
    assert [p.optimizer for p in plans] == [layout.optim_file(TAG, 0, r % 2, 0) for r in range(4)]
    assert plans[0] == plans[2] and plans[1] == plans[3]  # DP replicas read the same files
    for plan in plans:
        assert not plan.resharded and not plan.zero1_recut and plan.saved_zero1_dp is None
        assert plan.scheduler is None  # not asked for
        assert plan.user_content == layout.tag_path(TAG, layout.USER_CONTENT_FILE)
        assert not plan.share_reads and not plan.optimizer_shares_reads  # plain files: each rank reads alone


def test_only_the_targets_asked_for_are_planned():
    plan = _plans(_saved(), {"tp_size": 2, "dp_size": 2}, model=False, scheduler=True)[1]
    assert plan.model is None and plan.optimizer == layout.optim_file(TAG, 0, 1, 0)
    assert plan.scheduler == layout.tag_path(TAG, layout.SCHEDULER_FILE)
    nothing = _plans(_saved(), {"tp_size": 2, "dp_size": 2}, model=False, optimizer=False)[0]
    assert (nothing.model, nothing.optimizer, nothing.resharded) == (None, None, False)


def test_zero1_shards_are_read_by_their_own_rank():
    plans = _plans(_saved(zero1=True, zero1_dp=2), {"tp_size": 2, "dp_size": 2})
    assert [p.optimizer for p in plans] == [layout.optim_file(TAG, r // 2, r % 2, 0) for r in range(4)]
    assert all(not p.zero1_recut and p.saved_zero1_dp == 2 for p in plans)


def test_zero1_at_another_dp_size_is_recut_from_every_shard_of_the_coordinate():
    info = _saved(dp=4, zero1=True, zero1_dp=4)
    sizes = {"tp_size": 2, "dp_size": 2}
    plan = _plans(info, sizes)[3]
    assert plan.zero1_recut and plan.saved_zero1_dp == 4 and not plan.resharded
    assert plan.optimizer == layout.optim_file(TAG, 1, 1, 0)  # the name its state is reported under
    read = files_read(TAG, info, Topology(**sizes, rank=3), 3)
    assert [layout.optim_file(TAG, d, 1, 0) for d in range(4)] == [p for p in read if "/optim/" in p]


def test_merged_zero1_files_are_recut_from_the_full_file():
    info = _saved(full=True)
    plan = _plans(info, {"tp_size": 2, "dp_size": 2})[1]
    assert plan.zero1_recut and plan.saved_zero1_dp is None
    assert layout.full_optim_file(TAG, 1, 0) in files_read(TAG, info, Topology(tp_size=2, dp_size=2, rank=1), 1)


def test_another_tp_size_is_resharded_and_names_no_file_of_its_own():
    plans = _plans(_saved(tp=2), {"tp_size": 1, "dp_size": 4})
    assert all(p.resharded and p.model is None and p.optimizer is None for p in plans)
    assert changes_layout(_saved(tp=2), Topology(tp_size=1, dp_size=4))
    # without a model or optimizer there is nothing to re-shard: the scheduler and user content still load
    assert not _plans(_saved(tp=2), {"tp_size": 1, "dp_size": 4}, model=False, optimizer=False)[0].resharded


def test_a_layout_that_cannot_change_is_refused_before_anything_is_read():
    with pytest.raises(LayoutMismatchError, match="mem://ckpt/step5 was saved with expert parallelism EP=1"):
        _plans(_saved(tp=1, dp=2), {"dp_size": 2, "ep_size": 2})
    assert not changes_layout(_saved(tp=1, dp=2), Topology(dp_size=2, ep_size=2))  # refused, not re-sharded


def test_dp_replicas_share_xser_reads_only_when_they_load_in_one_wave():
    sizes = {"tp_size": 2, "dp_size": 2, "local_world_size": 4}
    shared = _plans(_saved(xser=True), sizes, num_workers=4)[0]
    assert shared.share_reads and shared.optimizer_shares_reads
    assert not _plans(_saved(xser=True), sizes, num_workers=2)[0].share_reads  # two waves
    zero1 = _plans(_saved(xser=True, zero1=True, zero1_dp=2), sizes, num_workers=4)[0]
    assert zero1.share_reads and not zero1.optimizer_shares_reads  # a ZeRO-1 shard is this rank's alone
    nothing = _plans(_saved(xser=True), sizes, model=False, optimizer=False, num_workers=4)[0]
    assert not nothing.share_reads


def test_files_read_names_everything_a_rank_may_read_and_nothing_of_other_coordinates():
    info = _saved()
    read = files_read(TAG, info, Topology(tp_size=2, dp_size=2, rank=1), 1)
    assert read == [
        layout.model_file(TAG, 1, 0),
        layout.optim_file(TAG, 0, 1, 0),
        layout.tag_path(TAG, layout.SCHEDULER_FILE),
        layout.tag_path(TAG, layout.USER_CONTENT_FILE),
        metadata_path(TAG),
        layout.rank_state_file(TAG, 1),
    ]
    master = files_read(TAG, info, Topology(tp_size=2, dp_size=2), 0)
    assert layout.gathered_rank_states_file(TAG) in master  # the master probes the gathered rank-state file


def test_with_expert_parallelism_the_ep_rank_00_files_are_read_too():
    info = _saved(tp=1, dp=2, ep=2)
    sizes = {"dp_size": 2, "ep_size": 2}
    plan = _plans(info, sizes)[1]
    assert plan.model == layout.model_file(TAG, 0, 0, 1)
    read = files_read(TAG, info, Topology(**sizes, rank=1), 1)
    assert layout.model_file(TAG, 0, 0, 1) in read and layout.model_file(TAG, 0, 0, 0) in read


def test_a_plan_is_a_frozen_value():
    first, again = (_plans(_saved(), {"tp_size": 2, "dp_size": 2})[1] for _ in range(2))
    assert first == again
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.model = "elsewhere"  # type: ignore[misc]
