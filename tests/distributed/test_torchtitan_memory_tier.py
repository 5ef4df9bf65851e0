"""The memory tier through ``nxd_ckpt.torchtitan.CheckpointManager`` (``Config.memory_tier``) on 2 spawned gloo
ranks as 2 simulated nodes (LOCAL_WORLD_SIZE=1), each node with its own memory directory: a job saves five steps
asynchronously (durable every 2nd save, the memory budget holding two steps); after one node's memory is lost a
restarted job resumes the newest step from the surviving node's replica bit-exactly; with both lost it resumes
the newest durable step."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip(
    "torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]', Python >= 3.11)"
)

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from harness.titan_job import TitanJob, assert_same_state
from nxd_ckpt.torchtitan import CheckpointManager

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane

STEPS = 5
DURABLE_EVERY = 2


def _config(base: str, mem: str, **fields: object) -> CheckpointManager.Config:
    os.environ["NXD_CKPT_MEMORY_TIER_HOST"] = "127.0.0.1"  # this rank's process: peers meet on loopback only
    tier = nxd.MemoryTier(
        dir=os.path.join(mem, "node{node}"), replicas=1, durable_every=DURABLE_EVERY, max_copies=4, bind="127.0.0.1"
    )
    return CheckpointManager.Config(
        enable=True, folder=os.path.join(base, "ckpt"), last_save_model_only=False, memory_tier=tier, **fields
    )


def _save_job(base: str, mem: str, expected: str) -> None:
    """Train STEPS steps, an async save through the tier after each; keep each step's state aside."""
    warnings.simplefilter("ignore")
    rank = dist.get_rank()

    def keep(job: TitanJob) -> None:
        torch.save(job.state(), os.path.join(expected, f"step-{job.train_state.step}_rank{rank}.pt"))

    job = TitanJob(_config(base, mem, interval=1, async_mode="async"), seed=0)
    job.train(STEPS, after_save=keep)
    job.checkpointer.close()


def _restore_job(base: str, mem: str, expected: str, step: int, remote_ranks: list[int], durable: bool) -> None:
    """A restarted job resumes ``step`` (the newest across the tiers), from another node's memory on
    ``remote_ranks``, from the folder when ``durable``; bit-exactly the state that step saved."""
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    job = TitanJob(_config(base, mem), seed=1)
    assert job.checkpointer.load()
    reader = job.checkpointer.last_reader
    assert reader is not None
    assert (reader.tier_view is None) == durable
    if reader.tier_view is not None:
        assert (reader.tier_view.bytes_remote > 0) == (rank in remote_ranks), (rank, reader.tier_view.bytes_remote)
    saved = torch.load(os.path.join(expected, f"step-{step}_rank{rank}.pt"), weights_only=True)
    assert_same_state(saved, job.state())
    job.checkpointer.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("titan_tier")
    base, mem, expected = (str(root / d) for d in ("job", "mem", "expected"))
    os.makedirs(expected)
    run_on_ranks(_save_job, 2, dict(base=base, mem=mem, expected=expected), ranks_per_node=1)
    return base, mem, expected


def _restore(saved: tuple[str, str, str], mem: str, step: int, remote_ranks: list[int], durable: bool) -> None:
    base, _, expected = saved
    kwargs = dict(base=base, mem=mem, expected=expected, step=step, remote_ranks=remote_ranks, durable=durable)
    run_on_ranks(_restore_job, 2, kwargs, ranks_per_node=1)


def _memory_copy(saved: tuple[str, str, str], tmp_path) -> str:
    mem = str(tmp_path / "mem")
    shutil.copytree(saved[1], mem)
    return mem


def test_saves_go_to_memory_and_the_peer_and_to_the_folder_every_kth(saved):
    base, mem, _ = saved
    assert sorted(os.listdir(os.path.join(base, "ckpt"))) == ["step-2", "step-4"]  # durable every 2nd save
    for node in (0, 1):
        (root,) = os.listdir(os.path.join(mem, f"node{node}"))
        shares = os.path.join(mem, f"node{node}", root)
        assert sorted(os.listdir(shares)) == ["node_00000", "node_00001"]  # its own and the other node's replica
        for share in ("node_00000", "node_00001"):
            assert sorted(os.listdir(os.path.join(shares, share))) == ["step-4", "step-5"]  # two steps kept
    coordinator_share = os.path.join(mem, "node1", root, "node_00000", "step-5")
    assert ".metadata" in os.listdir(coordinator_share)  # rank 0's replica on node 1 carries .metadata


def test_a_lost_node_resumes_the_newest_step_from_the_peer_replica(saved, tmp_path):
    mem = _memory_copy(saved, tmp_path)
    shutil.rmtree(os.path.join(mem, "node0"))  # node 0 replaced: its processes and its memory are gone
    _restore(saved, mem, STEPS, remote_ranks=[0], durable=False)


def test_both_nodes_lost_resume_the_newest_durable_step(saved, tmp_path):
    mem = _memory_copy(saved, tmp_path)
    shutil.rmtree(os.path.join(mem, "node0"))
    shutil.rmtree(os.path.join(mem, "node1"))
    _restore(saved, mem, 4, remote_ranks=[], durable=True)
