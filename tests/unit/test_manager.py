"""The manager's policies in one process: ranks as threads (``testing.threadworld``: collectives at a thread
barrier, the commit over a real TCPStore on 127.0.0.1), coordinator, topology and storage injected; and the
write plan as a pure function."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import layout, manifests, tags
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import plan
from nxd_ckpt.storage import DelegatingStorage, LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training
from nxd_ckpt.testing.threadworld import ThreadWorld

# --------------------------------------------------------------------------------------------- the write plan


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64 * (i + 1), generator=g) for i in range(6)} | {"step": torch.tensor(3.0)}


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
@pytest.mark.parametrize("zero1", [False, True], ids=["replicated", "zero1"])
def test_plan_save_decides_who_writes_what(use_xser, zero1):
    """TP=2, DP=2 (ranks 0..3): model and replicated optimizer by DP rank 0 (every replica with xser), ZeRO-1
    shards by everyone, scheduler and user content by the master only."""
    by_rank = {}
    for rank in range(4):
        topo = Topology(tp_size=2, dp_size=2, rank=rank)
        writes = plan.plan_save(
            topo, "t", model={}, optimizer={}, scheduler={}, user_content={}, zero1=zero1, use_xser=use_xser
        )
        by_rank[rank] = {(w.kind, w.path.split("/", 1)[1], w.replicas, w.xser) for w in writes}
    model = lambda tp, reps: ("model", f"model/{layout.state_file_name(0, tp, 0)}", reps, use_xser)  # noqa: E731
    assert model(0, (0, 2)) in by_rank[0] and model(1, (1, 3)) in by_rank[1]
    assert any(k == "model" for k, *_ in by_rank[2]) is use_xser  # DP rank 1 writes a share only with xser
    for rank in range(4):
        optim = [w for w in by_rank[rank] if w[0] == "optimizer"]
        dp, tp = divmod(rank, 2)
        if zero1:
            assert optim == [("optimizer", f"optim/{layout.state_file_name(dp, tp, 0)}", (rank,), use_xser)]
        else:
            assert len(optim) == (1 if dp == 0 or use_xser else 0)
        master_files = {k for k, *_ in by_rank[rank]} & {"scheduler", "user_content"}
        assert master_files == ({"scheduler", "user_content"} if rank == 0 else set())
        assert all(not x for k, _, _, x in by_rank[rank] if k in ("scheduler", "user_content"))  # always plain


def test_xser_replicas_split_the_tensor_files_and_staging_needs_only_the_share(monkeypatch):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    state = _state(1)
    writes = [plan.StateWrite("model", "t/model/x.pt", state, (0, 2), xser=True)]
    shares = {r: plan.tensors_to_write(writes, r) for r in (0, 2)}
    ids = {r: {id(t) for t in ts} for r, ts in shares.items()}
    assert not ids[0] & ids[2] and ids[0] | ids[2] == {id(t) for t in state.values()}
    assert plan.tensors_to_write(writes, 0) == shares[0]  # pure: same answer every time
    plain_write = [plan.StateWrite("model", "t/model/x.pt", state, (0, 2))]
    assert {id(t) for t in plan.tensors_to_write(plain_write, 2)} == {id(t) for t in state.values()}
    with pytest.raises(ValueError, match="not one of the replicas"):
        plan.tensors_to_write(writes, 1)


# --------------------------------------------------------------------------------------------- the manager


class _RecordingStorage(DelegatingStorage):
    """Local storage that remembers what this rank deleted (retention must be rank 0's alone)."""

    def __init__(self, root: str, deleted: list[str]) -> None:
        super().__init__(LocalStorage(root))
        self.deleted = deleted

    def delete_tree(self, path: str) -> None:
        self.deleted.append(path)
        self.inner.delete_tree(path)


def _managers(world: ThreadWorld, topo: dict, deleted: dict[int, list[str]] | None = None) -> list:
    def storage_for(rank: int):  # type: ignore[no-untyped-def]
        return lambda d: _RecordingStorage(os.fspath(d), deleted.setdefault(rank, [])) if deleted is not None else None

    return [
        CheckpointManager(
            coordinator=world.coordinator(r),
            topology=Topology(rank=r, **topo),
            storage=storage_for(r) if deleted is not None else None,
        )
        for r in range(world.size)
    ]


def test_zero1_save_each_rank_writes_its_own_files_and_rank0_commits(tmp_path):
    world = ThreadWorld(2)
    managers = _managers(world, {"dp_size": 2})
    model = {"w": torch.arange(6.0)}

    def save(rank: int) -> None:
        shard = {"base_state": {0: {"exp_avg": torch.full((3,), float(rank))}}, "shape_info": {0: torch.Size([6])}}
        report = managers[rank].save(tmp_path, "t1", model=model, optimizer=shard, zero1_optimizer=True)
        assert report.completed

    world.run(save)
    storage = LocalStorage(tmp_path)
    written = {}
    for path in manifests.manifest_paths(storage, "t1"):
        rank, records = manifests.parse_manifest(storage.read_bytes(path), path)
        written[rank] = sorted(records)
    assert written[1] == [f"optim/{layout.state_file_name(1, 0, 0)}"]
    assert f"model/{layout.state_file_name(0, 0, 0)}" in written[0] and layout.METADATA_FILE in written[0]
    meta = json.loads(storage.read_bytes("t1/nxd_ckpt.json"))
    assert (meta["zero1_dp_size"], meta["layout"]["world_size"]) == (2, 2)
    assert nxd.verify(str(tmp_path), "t1").ok


def test_retention_is_applied_by_rank0_only(tmp_path):
    world = ThreadWorld(2)
    deleted: dict[int, list[str]] = {}
    managers = _managers(world, {"tp_size": 2}, deleted)

    def save_three(rank: int) -> None:
        for step in range(3):
            managers[rank].save(tmp_path, f"s{step}", model={"w": torch.ones(2) * rank}, num_kept_ckpts=2)

    world.run(save_three)
    managers[0].wait_retention()  # rank 0's deletions run on its writer thread, after the commit
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "s1", "s2"]
    tags_deleted = {r: [p for p in paths if "/" not in p] for r, paths in deleted.items()}  # not stale xser dirs
    assert tags_deleted == {0: ["s0"], 1: []}


def test_a_failed_rank_fails_the_save_everywhere_and_no_done(tmp_path):
    world = ThreadWorld(2)
    managers = _managers(world, {"tp_size": 2})

    class Unpicklable:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("cannot pickle this")

    def save(rank: int) -> str:
        content = {"bad": Unpicklable()} if rank == 0 else None
        try:
            managers[rank].save(tmp_path, "t1", model={"w": torch.ones(2)}, user_content=content)
        except CheckpointError as e:
            return type(e).__name__
        except RuntimeError as e:
            return str(e)
        return "saved"

    outcomes = world.run(save)
    assert "saved" not in outcomes and not (tmp_path / "t1" / "done").exists()


def test_fallback_loads_the_newest_verified_tag_on_every_rank_with_the_callers_options(tmp_path):
    world = ThreadWorld(2)
    managers = _managers(world, {"tp_size": 2})

    def save(rank: int) -> None:
        for step in (1, 2):
            managers[rank].save(tmp_path, f"s{step}", model={"w": torch.full((4,), float(10 * step + rank))})

    world.run(save)
    victim = tmp_path / "s2" / "model" / layout.state_file_name(0, 1, 0)  # written by rank 1
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))
            self.extra = torch.nn.Parameter(torch.zeros(1))  # not in the checkpoint

    def load(rank: int) -> torch.Tensor:
        target = Model()  # strict=False must reach the fallback's load (it used to go through locals())
        managers[rank].load(tmp_path, model=target, fallback_to_verified=True, strict=False)
        return target.w.detach()

    loaded = world.run(load)
    assert [float(t[0]) for t in loaded] == [10.0, 11.0]  # s1 on both ranks (rank 1 found s2 damaged)

    def load_strict(rank: int) -> None:
        managers[rank].load(tmp_path, model=Model(), fallback_to_verified=True)

    with pytest.raises(CheckpointError, match="extra"):  # not damage: raised, never skipped
        world.run(load_strict)


def test_commit_barrier_over_a_real_tcpstore_with_threads():
    """Rank 0 learns every arrival and error through the store; the others get the published outcome, as the
    failing rank's own exception type."""
    from nxd_ckpt.save.barrier import CommitBarrier

    world = ThreadWorld(3)

    def commit(rank: int, failing: int | None) -> object:
        seq = 1 if failing is None else 2
        barrier = CommitBarrier(world.store, "session", seq, rank, 3, timeout_s=20.0, tag=f"t{seq}")
        barrier.arrive(OSError(28, "disk full") if rank == failing else None)
        if rank != 0:
            try:
                barrier.wait_outcome()
            except OSError as e:
                return f"{type(e).__name__}: {e}"
            return "ok"
        failures = barrier.wait_all_arrived()
        barrier.publish_outcome(failures[min(failures)] if failures else None)
        return {r: f.qualname for r, f in failures.items()}

    assert world.run(lambda r: commit(r, None)) == [{}, "ok", "ok"]
    outcome = world.run(lambda r: commit(r, 2))
    assert outcome[0] == {2: "OSError"}
    assert outcome[1] == outcome[2] and outcome[1].startswith("OSError: rank 2 failed") and "disk full" in outcome[1]


def test_async_saves_commit_from_the_writer_threads(tmp_path):
    world = ThreadWorld(2)
    managers = _managers(world, {"tp_size": 2})

    def save(rank: int) -> bool:
        report = managers[rank].save(tmp_path, "a1", model={"w": torch.ones(3) * rank}, async_save=True)
        managers[rank].finalize()  # waits for the background write and the commit
        return report.completed

    assert world.run(save) == [True, True]
    assert (tmp_path / "a1" / "done").exists() and nxd.verify(str(tmp_path), "a1").ok


# --------------------------------------------------------------------------- deletions beside the next save
class _HeldDeletes(DelegatingStorage):
    """Deleting tag "a" as a whole waits until ``release`` is set (a slow file system freeing a large tag)."""

    def __init__(self, inner, release: threading.Event) -> None:
        super().__init__(inner)
        self.release = release
        self.deleting = threading.Event()

    def delete_tree(self, path: str) -> None:
        if path == "a" and not self.deleting.is_set():
            self.deleting.set()
            assert self.release.wait(30), "the test never released the deletion"
        super().delete_tree(path)


def _held_manager(tmp_path):
    release = threading.Event()
    storage = _HeldDeletes(LocalStorage(str(tmp_path)), release)
    return CheckpointManager(storage=lambda _directory: storage), storage


def test_a_save_does_not_wait_for_the_deletions_queued_behind_the_previous_one(tmp_path):
    """Retention runs on the writer thread after the save it follows; the next save neither waits for it (only
    for the previous save itself) nor writes a file before it is done, and what retention keeps is unchanged."""
    manager, storage = _held_manager(tmp_path)
    model, opt, _ = make_training(seed=1)
    for tag in ("a", "b"):
        manager.save(str(tmp_path), tag, model=model, optimizer=opt, num_kept_ckpts=1)
    assert storage.deleting.wait(10)  # retention after "b" is deleting "a", held
    safety = threading.Timer(10, storage.release.set)  # without the fix the next save waits for it: fail, not hang
    safety.start()
    try:
        report = manager.save(str(tmp_path), "c", model=model, optimizer=opt, num_kept_ckpts=1, async_save=True)
        assert report.waited_s < 2 and not storage.release.is_set()
        storage.release.set()
        report.wait()
        manager.wait_retention()
    finally:
        safety.cancel()
        storage.release.set()
    manager.finalize()
    assert [t.name for t in tags.list_tags(LocalStorage(str(tmp_path)))] == ["c"]


def test_a_save_of_the_tag_being_deleted_waits_for_the_deletion(tmp_path):
    """Re-using the name of a tag that retention is deleting: rank 0 waits for the deletion before it touches the
    tag, so the deletion cannot remove the new save's files."""
    manager, storage = _held_manager(tmp_path)
    model, opt, _ = make_training(seed=1)
    for tag in ("a", "b"):
        manager.save(str(tmp_path), tag, model=model, optimizer=opt, num_kept_ckpts=1)
    assert storage.deleting.wait(10)  # retention after "b" is deleting "a" ('done' already gone), held
    threading.Timer(0.5, storage.release.set).start()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    report = manager.save(str(tmp_path), "a", model=model, optimizer=opt, num_kept_ckpts=1)
    assert report.blocked_s >= 0.4  # waited for the deletion of the old "a"
    manager.wait_retention()
    manager.finalize()
    fresh, fresh_opt, _ = make_training(seed=2)
    CheckpointManager().load(str(tmp_path), "a", model=fresh, optimizer=fresh_opt)
    assert_state_equal(fresh.state_dict(), expected)
    assert [t.name for t in tags.list_tags(LocalStorage(str(tmp_path)))] == ["a"]
