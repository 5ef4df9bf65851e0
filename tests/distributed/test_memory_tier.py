"""The memory tier on real spawned gloo ranks: 4 ranks as 2 simulated nodes (2 ranks each, LOCAL_WORLD_SIZE=2),
each node with its own memory directory. One job saves five steps (async, TP=2 x DP=2, durable every 2nd save,
memory budget of two tags); restarted jobs then restore after the failures each test simulates."""

from __future__ import annotations

import glob
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt.format import layout
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.testing.counting import ReadCountingStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps
from nxd_ckpt.tree import map_tensors

STEPS = 5
DURABLE_EVERY = 2


def _tier(mem: str) -> nxd.MemoryTier:
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"  # this rank's process: peers meet on loopback only
    return nxd.MemoryTier(
        dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=DURABLE_EVERY, max_copies=4, bind="127.0.0.1"
    )


def _save_job(ckpt: str, mem: str, expected: str) -> None:
    """Train and save STEPS steps through the tier, keep each step's state aside, then die by SIGKILL."""
    nxd.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, tp = dist.get_rank(), dist.get_rank() % 2
    model, opt, sched = make_training(seed=tp)
    for step in range(1, STEPS + 1):
        train_steps(model, opt, sched, 1, seed=10 * tp + step)
        report = nxd.save_checkpoint(
            ckpt, f"step_{step}", model=model, optimizer=opt, async_save=True, memory_tier=_tier(mem)
        )
        state = map_tensors({"model": model.state_dict(), "optimizer": opt.state_dict()}, lambda t: t.cpu().clone())
        torch.save(state, os.path.join(expected, f"step_{step}_rank{rank}.pt"))
        report.wait()
    nxd.finalize_checkpoint()
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # every process dies; the memory directories stay


def _restore_job(ckpt: str, mem: str, expected: str, tag: str, tiers: list[str], durable_state_reads: bool) -> None:
    """A restarted job: auto-latest load through the tier, counting what it reads from the checkpoint directory."""
    nxd.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    storages: dict[str, ReadCountingStorage] = {}

    def counting(path: object) -> ReadCountingStorage:
        return storages.setdefault(os.fspath(path), ReadCountingStorage(os.fspath(path)))  # type: ignore[arg-type]

    manager = CheckpointManager(storage=counting)
    model, opt, _ = make_training(seed=99)
    manager.load(ckpt, model=model, optimizer=opt, memory_tier=_tier(mem))
    restore = manager.last_restore
    assert restore is not None and (restore.tag, restore.tiers) == (tag, tiers), restore
    saved = torch.load(os.path.join(expected, f"{tag}_rank{rank}.pt"), weights_only=True)
    assert_state_equal(model.state_dict(), saved["model"])
    assert_state_equal(opt.state_dict(), saved["optimizer"])
    read = sorted(p for s in storages.values() for p in s.bytes_read if not p.endswith(layout.METADATA_FILE))
    if durable_state_reads:
        assert any(p.startswith(f"{tag}/model/") for p in read), read
    else:  # only tag listings (each tag's small metadata file) may touch durable storage
        assert read == [], f"rank {rank} read checkpoint files from durable storage: {read}"
    manager.finalize()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("memory_tier")
    ckpt, mem, expected = (str(base / d) for d in ("ckpt", "mem", "expected"))
    os.makedirs(expected)
    run_on_ranks(_save_job, 4, dict(ckpt=ckpt, mem=mem, expected=expected), ranks_per_node=2, sigkill_ok=True)
    return ckpt, mem, expected


def _node_root(mem: str, node: int) -> str:
    (root,) = glob.glob(os.path.join(mem, f"node{node}", "ckpt-*"))
    return root


def _copy_memory(saved, tmp_path) -> str:
    mem = str(tmp_path / "mem")
    shutil.copytree(saved[1], mem)
    return mem


def _restore(saved, mem: str, tag: str, tiers: list[str], durable_state_reads: bool = False) -> None:
    ckpt, _, expected = saved
    kwargs = dict(ckpt=ckpt, mem=mem, expected=expected, tag=tag, tiers=tiers, durable_state_reads=durable_state_reads)
    run_on_ranks(_restore_job, 4, kwargs, ranks_per_node=2)


def test_saves_go_to_memory_peer_and_durable_every_k(saved):
    ckpt, mem, _ = saved
    assert nxd.list_checkpoint_tags(ckpt) == ["step_2", "step_4"]  # durable every 2nd save
    for node in (0, 1):
        root = _node_root(mem, node)
        # own share and the other node's replica, each with the two newest tags (budget: 4 copies per node)
        assert sorted(os.listdir(root)) == ["node_00000", "node_00001"]
        for share in (0, 1):
            assert sorted(os.listdir(os.path.join(root, layout.memory_share_dir(share)))) == ["step_4", "step_5"]
            for rank in (2 * share, 2 * share + 1):
                for tag in ("step_4", "step_5"):
                    marker = layout.tier_marker_file(tag, rank)
                    assert os.path.isfile(os.path.join(root, layout.memory_share_dir(share), marker)), marker
        assert not os.path.exists(os.path.join(root, "node_00000", "step_5", layout.DONE_MARKER))


def test_every_process_killed_restores_from_local_memory(saved, tmp_path):
    mem = _copy_memory(saved, tmp_path)
    _restore(saved, mem, "step_5", ["memory"] * 4)


def test_lost_node_restores_newest_from_the_surviving_replica(saved, tmp_path):
    mem = _copy_memory(saved, tmp_path)
    shutil.rmtree(os.path.join(mem, "node0"))  # node 0 replaced: its processes and its memory are gone
    _restore(saved, mem, "step_5", ["peer", "peer", "memory", "memory"])


def test_lost_node_and_its_peer_fall_back_to_durable(saved, tmp_path):
    mem = _copy_memory(saved, tmp_path)
    shutil.rmtree(os.path.join(mem, "node0"))
    shutil.rmtree(os.path.join(mem, "node1"))
    _restore(saved, mem, "step_4", ["durable"] * 4, durable_state_reads=True)


def test_corrupted_local_copy_falls_back_to_the_peer_copy(saved, tmp_path):
    mem = _copy_memory(saved, tmp_path)
    model_file = os.path.join(_node_root(mem, 0), "node_00000", layout.model_file("step_5", 0, 0))
    with open(model_file, "r+b") as f:  # one flipped byte in node 0's own copy of rank 0's model file
        f.seek(os.path.getsize(model_file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    _restore(saved, mem, "step_5", ["peer", "memory", "memory", "memory"])


def test_corrupted_copies_everywhere_fall_back_to_durable(saved, tmp_path):
    mem = _copy_memory(saved, tmp_path)
    for node in (0, 1):
        model_file = os.path.join(_node_root(mem, node), "node_00000", layout.model_file("step_5", 0, 0))
        with open(model_file, "r+b") as f:
            f.truncate(os.path.getsize(model_file) - 1)
    _restore(saved, mem, "step_4", ["durable"] * 4, durable_state_reads=True)


def _unreachable_peer_job(ckpt: str, mem: str) -> None:
    """Node 1's file servers go away: node 0's pushes fail, and the save fails on every rank with that error."""
    rank = dist.get_rank()
    model = {"w": torch.full((1024,), float(rank % 2))}
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"
    tier = nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=1, bind="127.0.0.1")
    nxd.save_checkpoint(ckpt, "ok", model=model, async_save=True, memory_tier=tier).wait()
    dist.barrier()
    if rank >= 2:
        nxd.get_manager()._tier_runtime.server.close()  # node 1 stops serving (its processes stay in the job)
    dist.barrier()
    report = nxd.save_checkpoint(ckpt, "lost_copy", model=model, async_save=True, memory_tier=tier)
    with pytest.raises(nxd.StorageError, match="cannot reach the memory-tier peer"):  # every rank, same type
        report.wait()
    dist.barrier()  # a rank whose own push failed is done at once: its server stays up for the others' pushes
    with pytest.raises(nxd.AsyncSaveError, match="cannot reach the memory-tier peer"):
        nxd.finalize_checkpoint()
    assert nxd.latest_checkpoint_tag(ckpt) == "ok"  # no 'done' for the save whose copy failed
    nxd.reset_manager()


def test_unreachable_peer_fails_the_save_on_every_rank(tmp_path):
    kwargs = dict(ckpt=str(tmp_path / "ckpt"), mem=str(tmp_path / "mem"))
    run_on_ranks(_unreachable_peer_job, 4, kwargs, ranks_per_node=2)


RESTORE_STEPS = 7
"""World-wide coordinator steps of a restore from node memory on a fresh manager (tier set-up included)."""


def _counted_restore_job(ckpt: str, mem: str) -> None:
    """A restore's fixed cost is its world-wide steps. Set-up is one step (addresses, the job's token
    and the host names together), the restore reuses the layout it agreed on, and a plain tag makes no replica
    groups (only xser files share reads between replicas)."""
    from nxd_ckpt.ranks.coordinator import Coordinator

    rank = dist.get_rank()
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"
    tier = nxd.MemoryTier(dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=1, bind="127.0.0.1")
    model = {"w": torch.full((1024,), float(rank + 1)), "b": torch.arange(8.0)}
    nxd.save_checkpoint(ckpt, "s1", model=model, async_save=True, memory_tier=tier).wait()
    nxd.finalize_checkpoint()
    nxd.reset_manager()
    steps: list[str] = []
    arrive = Coordinator._arrive_and_wait

    def counting(self: Coordinator, phase: str) -> None:
        steps.append(phase)
        arrive(self, phase)

    Coordinator._arrive_and_wait = counting  # type: ignore[method-assign]
    try:
        manager = CheckpointManager()
        target = {"w": torch.zeros(1024), "b": torch.zeros(8)}
        manager.load(ckpt, model=target, memory_tier=tier)
    finally:
        Coordinator._arrive_and_wait = arrive  # type: ignore[method-assign]
    assert manager.last_restore is not None and manager.last_restore.tiers == ["memory", "memory"]
    assert torch.equal(target["w"], torch.full((1024,), 1.0)) and torch.equal(target["b"], torch.arange(8.0))
    set_up = [p for p in steps if "memory tier: exchanging" in p or "host names" in p or "token" in p]
    assert set_up == ["memory tier: exchanging the file servers' addresses"], steps
    assert manager.coordinator()._subgroups == {}, "a plain tag's load made replica groups"
    assert len(steps) <= RESTORE_STEPS, steps
    manager.finalize()

    # From the peer (node 0's memory lost): no file crosses the network twice (manifests and metadata are
    # read on several steps; the view keeps the small ones it fetched).
    from nxd_ckpt.tier.transport import FileClient

    dist.barrier()
    if rank == 0:
        os.rename(os.path.join(mem, "node0"), os.path.join(mem, "node0.lost"))
    dist.barrier()
    fetched: list[str] = []
    get, stream = FileClient.get, FileClient.open_stream

    def counting_get(self, address, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        fetched.append(path)
        return get(self, address, path, *args, **kwargs)

    def counting_stream(self, address, path):  # type: ignore[no-untyped-def]
        fetched.append(path)
        return stream(self, address, path)

    FileClient.get, FileClient.open_stream = counting_get, counting_stream  # type: ignore[method-assign]
    try:
        manager = CheckpointManager()
        target = {"w": torch.zeros(1024), "b": torch.zeros(8)}
        manager.load(ckpt, model=target, memory_tier=tier)
    finally:
        FileClient.get, FileClient.open_stream = get, stream  # type: ignore[method-assign]
    assert manager.last_restore is not None and manager.last_restore.tiers == ["peer", "memory"]
    assert torch.equal(target["w"], torch.full((1024,), 1.0))
    if rank == 0:
        assert fetched and len(fetched) == len(set(fetched)), fetched
    manager.finalize()


def test_a_restore_from_memory_takes_few_world_wide_steps(tmp_path):
    kwargs = dict(ckpt=str(tmp_path / "ckpt"), mem=str(tmp_path / "mem"))
    run_on_ranks(_counted_restore_job, 2, kwargs, ranks_per_node=1)


def _gather_and_master_job() -> None:
    """One step carries every rank's object and rank 0's result, or rank 0's error raised on every rank."""
    from nxd_ckpt.ranks.coordinator import Coordinator

    coord = Coordinator()
    rank = coord.rank
    assert coord.gather_and_master_computes(rank * 10, lambda: "from rank 0", "both") == ([0, 10], "from rank 0")

    def broken() -> None:
        raise nxd.FormatError("rank 0 could not list")

    with pytest.raises(nxd.FormatError, match="rank 0 could not list"):
        coord.gather_and_master_computes(rank, broken, "both")
    assert coord.all_gather_object(rank, phase="still in step") == [0, 1]


def test_gather_and_master_computes_in_one_step():
    run_on_ranks(_gather_and_master_job, 2)
