"""The steps of the save and load pipelines, each alone: preparing a tag, the commit, agreeing on a candidate,
the read plan's errors. Ranks are threads (``testing.threadworld``) where a step is collective."""

from __future__ import annotations

import os

import pytest
import torch

from nxd_ckpt.errors import FormatError, IntegrityError, LayoutMismatchError, RemoteRankError, StorageError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import describe
from nxd_ckpt.format.metadata import TagMetadata, read_metadata
from nxd_ckpt.load.candidates import Outcome, settle
from nxd_ckpt.load.read import loaded_bytes, missing_file_error
from nxd_ckpt.load.read_plan import check_layout
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import commit
from nxd_ckpt.save.barrier import CommitBarrier
from nxd_ckpt.save.commit import CommitTarget, prepare_tag
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.threadworld import ThreadWorld
from nxd_ckpt.watchdog import StorageMonitor


# --------------------------------------------------------------------------------------------- begin
def test_prepare_tag_marks_a_new_tag_and_clears_leftovers(tmp_path):
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes("t/nxd_ckpt.json", b"stale")  # an interrupted earlier save of the same tag
    created_at, resave = prepare_tag(storage, "t", durable=True)
    assert not resave and created_at > 0
    assert storage.exists(layout.tag_path("t", layout.CHECKPOINT_MARKER))
    assert not storage.exists("t/nxd_ckpt.json")


def test_prepare_tag_resaves_a_complete_tag_beside_it(tmp_path):
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes(layout.tag_path("t", layout.CHECKPOINT_MARKER), b"1")
    storage.write_bytes(layout.model_file("t", 0, 0), b"state")
    storage.write_bytes(layout.tag_path("t", layout.DONE_MARKER), b"1")
    _, resave = prepare_tag(storage, "t", durable=True)
    assert resave
    assert storage.exists(layout.tag_path("t", layout.DONE_MARKER))  # the old one stays loadable until the swap


def test_prepare_tag_writes_in_place_over_a_bare_done(tmp_path):
    """optimum-neuron touches ``shards/done`` before its async save into a new directory: no checkpoint to keep."""
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes(layout.tag_path("t", layout.DONE_MARKER), b"")
    _, resave = prepare_tag(storage, "t", durable=True)
    assert not resave and not storage.exists(layout.tag_path("t", layout.DONE_MARKER))


def test_prepare_tag_leaves_the_directory_alone_for_a_memory_only_save(tmp_path):
    _, resave = prepare_tag(LocalStorage(str(tmp_path)), "t", durable=False)
    assert not resave and os.listdir(tmp_path) == []


def test_a_resave_is_written_beside_the_complete_tag_and_swapped_in_by_the_commit(tmp_path):
    """One owner, begin to end: ``prepare_tag`` begins the re-save, ``open_target`` writes it under the tag's names
    into the hidden directory (the old copy untouched), ``commit`` gives it the tag's name with ``done`` last."""
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes(layout.tag_path("t", layout.CHECKPOINT_MARKER), b"1")
    storage.write_bytes(layout.model_file("t", 0, 0), b"old")
    storage.write_bytes(layout.tag_path("t", layout.DONE_MARKER), b"1")
    created_at, resaved = prepare_tag(storage, "t", durable=True)
    target = commit.open_target(
        storage, "t", rank=0, world_size=1, created_at=created_at, resaved=resaved, durable=True, timeout_s=60.0,
        topology=Topology(rank=0), zero1=False, use_xser=False, items=("model",), saved_async=False, sharding=None,
    )  # fmt: skip
    target.storage.write_bytes(layout.model_file("t", 0, 0), b"new")
    target.storage.write_manifest()
    assert storage.read_bytes(layout.model_file("t", 0, 0)) == b"old"  # still the loadable copy
    assert (tmp_path / layout.resave_dir("t")).is_dir()
    commit.commit(CommitBarrier(None, "s", 1, 0, 1, 60.0, "t"), target, 0, None)
    assert storage.read_bytes(layout.model_file("t", 0, 0)) == b"new"
    assert (
        storage.exists(layout.tag_path("t", layout.DONE_MARKER))
        and read_metadata(storage, "t").created_at == created_at
    )
    assert not (tmp_path / layout.resave_dir("t")).exists()


# --------------------------------------------------------------------------------------------- commit
def _commit_target(storage: LocalStorage, world_size: int, durable: bool = True) -> CommitTarget:
    from nxd_ckpt.format.integrity import ChecksummingStorage

    return CommitTarget(
        storage=ChecksummingStorage(storage, "t", 0),
        metadata=TagMetadata(
            tag="t", created_at=1.0, tp=1, pp=1, dp=world_size, world_size=world_size, xser=True, items=("model",)
        ),
        topology=Topology(dp_size=world_size, rank=0),
        monitor=StorageMonitor("committing", 60.0),
        root=storage if durable else None,
    )


def _commit_in_world(tmp_path, errors: dict[int, BaseException], durable: bool = True) -> list[object]:
    world = ThreadWorld(2)
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes(layout.tag_path("t", layout.CHECKPOINT_MARKER), b"1")

    def rank_main(rank: int) -> object:
        barrier = CommitBarrier(world.store, "s", 1, rank, 2, 60.0, "t")
        try:
            commit.commit(barrier, _commit_target(storage, 2, durable), rank, errors.get(rank))
        except BaseException as e:
            return e
        return "ok"

    return world.run(rank_main)


def test_commit_writes_metadata_and_done_once_every_rank_arrived(tmp_path):
    assert _commit_in_world(tmp_path, {}) == ["ok", "ok"]
    storage = LocalStorage(str(tmp_path))
    assert storage.exists(layout.tag_path("t", layout.DONE_MARKER))
    meta = read_metadata(storage, "t")
    assert (meta.world_size, meta.xser, meta.items) == (2, True, ("model",))


def test_commit_fails_every_rank_with_the_failing_ranks_error_type(tmp_path):
    outcomes = _commit_in_world(tmp_path, {1: StorageError("disk full on rank 1")})
    assert all(isinstance(o, StorageError) for o in outcomes), outcomes
    assert "disk full on rank 1" in str(outcomes[0])
    assert not LocalStorage(str(tmp_path)).exists(layout.tag_path("t", layout.DONE_MARKER))


def test_commit_of_a_memory_only_save_writes_no_done(tmp_path):
    assert _commit_in_world(tmp_path, {}, durable=False) == ["ok", "ok"]
    assert not LocalStorage(str(tmp_path)).exists(layout.tag_path("t", layout.DONE_MARKER))


# --------------------------------------------------------------------------------------------- agreeing
def test_outcome_tells_damage_from_other_failures():
    damaged = IntegrityError("t/model/x.pt is corrupt")
    assert Outcome.of(None, 0) == Outcome(None, None, "")
    assert Outcome.of(damaged, 0).verdict == "damaged" and Outcome.of(damaged, 0).found_here
    damaged.origin_rank = 1  # raised here, found on rank 1
    assert not Outcome.of(damaged, 0).found_here
    assert Outcome.of(RuntimeError("x"), 0).verdict == "RuntimeError"


def _settle_in_world(errors: dict[int, BaseException]) -> list[object]:
    world = ThreadWorld(2)

    def rank_main(rank: int) -> object:
        error = errors.get(rank)
        try:
            return [o.verdict for o in settle(world.coordinator(rank), Outcome.of(error, rank), error, "agreeing")]
        except BaseException as e:
            return e

    return world.run(rank_main)


def test_settle_moves_every_rank_on_when_one_found_damage():
    assert _settle_in_world({1: FormatError("missing")}) == [[None, "damaged"], [None, "damaged"]]


def test_settle_raises_on_every_rank_when_one_failed_otherwise():
    outcomes = _settle_in_world({1: ValueError("bad state")})
    assert isinstance(outcomes[0], RemoteRankError) and "ValueError" in str(outcomes[0])
    assert isinstance(outcomes[1], ValueError)


def test_settle_returns_when_all_loaded():
    assert _settle_in_world({}) == [[None, None], [None, None]]


# --------------------------------------------------------------------------------------------- choose and read
def test_a_missing_state_file_says_why(tmp_path):
    storage = LocalStorage(str(tmp_path))
    error = missing_file_error(storage, "t/model/dp_rank_00_tp_rank_00_pp_rank_00.pt")
    assert "is missing; the checkpoint is damaged or was saved without this state" in str(error)
    storage.write_bytes(layout.tag_path("t", layout.OPTIM_DIR, layout.DCP_METADATA_FILE), b"x")
    error = missing_file_error(storage, "t/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt")
    assert "torch Distributed Checkpoint format" in str(error)


def test_check_layout_reshards_tp_changes_and_refuses_ep_changes(tmp_path):
    storage = LocalStorage(str(tmp_path))
    for tp in range(2):
        storage.write_bytes(f"t/model/{layout.state_file_name(0, tp, 0)}", b"x")
    info = describe(storage, "t")
    assert check_layout(info, Topology(tp_size=2, rank=0), "u", "t") is False
    assert check_layout(info, Topology(tp_size=1, rank=0), "u", "t") is True
    with pytest.raises(LayoutMismatchError, match="expert parallelism EP=1"):
        check_layout(info, Topology(tp_size=2, dp_size=2, ep_size=2, rank=0), "u", "t")


def test_loaded_bytes_counts_modules_and_dicts():
    module = torch.nn.Linear(4, 2)
    assert loaded_bytes(module, {"x": torch.zeros(3)}, None) == (8 + 2) * 4 + 3 * 4
