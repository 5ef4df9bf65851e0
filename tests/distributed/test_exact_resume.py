"""Exact resume on real gloo ranks: a StatefulDataLoader with workers and shuffling, dropout, and every RNG.

Run A trains N+M steps without stopping. Run B trains N steps and saves (per-rank files, async, and the
gather-to-master file, sync); fresh processes then load and train M steps. The batches each rank sees and its
losses must equal run A's exactly. A changed world size must fail clearly, and skip_rank_state=True must work.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt.testing.fakes import lane_device, make_training

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

WORLD = 2
N_STEPS = 4  # before the save
M_STEPS = 5  # after it; 6 batches per epoch per rank, so the resumed run crosses an epoch boundary
PER_RANK_TAG = "step_4_per_rank"
GATHER_TAG = "step_4_gather"


class Samples(Dataset):
    """48 samples whose contents depend only on the index (workers reseed their own streams on resume)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(index)
        return {"index": index, "x": torch.randn(8, generator=g), "y": torch.randn(4, generator=g)}


class EpochCounter:
    """The training loop's own per-rank position: which epoch the loader is in."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


class Trainer:
    """A DP training loop: dropout, Python/NumPy noise, gradients averaged over gloo, a shuffled loader.

    It trains on the lane's device: in the XLA lane dropout draws from torch_xla's RNG, saved with the rest.
    """

    def __init__(self) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.device = lane_device()
        self.model, self.opt, self.sched = make_training(seed=0, dropout=0.3, device=self.device)
        torch.manual_seed(1000 + rank)  # each rank its own dropout stream
        if self.device.type == "xla":  # torch.manual_seed does not seed the XLA device's stream
            __import__("torch_xla.core.xla_model").core.xla_model.set_rng_state(1000 + rank)
        random.seed(2000 + rank)
        np.random.seed(3000 + rank)
        self.sampler = DistributedSampler(Samples(), num_replicas=world, rank=rank, shuffle=True, seed=7)
        # The loader draws its workers' base seed from its own generator, not from the global torch stream:
        # the resumed iterator draws one too, which would otherwise shift the restored dropout stream.
        self.loader = StatefulDataLoader(
            Samples(),
            batch_size=4,
            sampler=self.sampler,
            num_workers=2,
            generator=torch.Generator().manual_seed(4000 + rank),
            # Ranks are spawned, which makes "spawn" the default here too: fork, as a torchrun job would.
            multiprocessing_context="fork",
        )
        self.position = EpochCounter()
        self._it = None

    def rank_state(self) -> dict:
        return {"loader": self.loader, "position": self.position}

    def _next_batch(self) -> dict:
        if self._it is None:
            self.sampler.set_epoch(self.position.epoch)
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self.position.epoch += 1
            self.sampler.set_epoch(self.position.epoch)
            self._it = iter(self.loader)
            return next(self._it)

    def steps(self, count: int) -> list[dict]:
        records = []
        for _ in range(count):
            batch = self._next_batch()
            scale = 1.0 + 0.01 * random.random()
            noise = torch.from_numpy(np.random.normal(0.0, 0.01, size=(4, 8)).astype(np.float32))
            out = self.model((batch["x"] * scale + noise).to(self.device))
            loss = torch.nn.functional.mse_loss(out, batch["y"].to(self.device))
            self.opt.zero_grad()
            loss.backward()
            for p in self.model.parameters():  # gloo only ever sees CPU tensors
                grad = p.grad.cpu()
                dist.all_reduce(grad)
                p.grad.copy_(grad / dist.get_world_size())
            self.opt.step()
            self.sched.step()
            if self.device.type == "xla":
                __import__("torch_xla").sync()
            records.append({"indices": batch["index"].tolist(), "loss": loss.item()})
        return records


def _records_file(root: str, run: str) -> str:
    return os.path.join(root, f"records_{run}_rank{dist.get_rank()}.json")


def _run_a(root: str) -> None:
    trainer = Trainer()
    with open(_records_file(root, "A"), "w") as f:
        json.dump(trainer.steps(N_STEPS + M_STEPS), f)


def _run_b_save(root: str) -> None:
    trainer = Trainer()
    trainer.steps(N_STEPS)
    ckpt = os.path.join(root, "ckpt")
    common = {"model": trainer.model, "optimizer": trainer.opt, "scheduler": trainer.sched}
    report = nxd.save_checkpoint(
        ckpt, PER_RANK_TAG, **common, rank_state=trainer.rank_state(), save_rng=True, async_save=True
    )
    nxd.save_checkpoint(
        ckpt, GATHER_TAG, **common, rank_state=trainer.rank_state(), save_rng=True, rank_state_mode="gather"
    )
    report.wait()
    nxd.finalize_checkpoint()


def _run_b_resume(root: str, tag: str) -> None:
    trainer = Trainer()
    nxd.load_checkpoint(
        os.path.join(root, "ckpt"),
        tag,
        model=trainer.model,
        optimizer=trainer.opt,
        scheduler=trainer.sched,
        rank_state=trainer.rank_state(),
    )
    resumed = trainer.steps(M_STEPS)
    with open(_records_file(root, "A")) as f:
        expected = json.load(f)[N_STEPS:]
    assert [r["indices"] for r in resumed] == [r["indices"] for r in expected], "batches differ after resume"
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected], "losses differ after resume"


def _load_with_other_world(root: str, tag: str) -> None:
    ckpt = os.path.join(root, "ckpt")
    trainer = Trainer()
    with pytest.raises(nxd.LayoutMismatchError, match=r"world 2\).*skip_rank_state=True"):
        nxd.load_checkpoint(ckpt, tag, model=trainer.model, rank_state=trainer.rank_state())
    # Everything else still loads when per-rank state is skipped.
    content = nxd.load_checkpoint(ckpt, tag, model=trainer.model, skip_rank_state=True)
    assert content is None


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("exact_resume"))
    run_on_ranks(_run_a, WORLD, {"root": root})
    run_on_ranks(_run_b_save, WORLD, {"root": root})
    return root


def test_per_rank_files_resume_exactly(saved_runs):
    extras = os.path.join(saved_runs, "ckpt", PER_RANK_TAG, "nxd_ckpt")
    assert {"rank_state_00000.pt", "rank_state_00001.pt"} <= set(os.listdir(extras))
    run_on_ranks(_run_b_resume, WORLD, {"root": saved_runs, "tag": PER_RANK_TAG})


def test_gather_to_master_resumes_exactly(saved_runs):
    extras = os.path.join(saved_runs, "ckpt", GATHER_TAG, "nxd_ckpt")
    assert "rank_states.pt" in os.listdir(extras)
    assert not any(name.startswith("rank_state_") for name in os.listdir(extras))
    run_on_ranks(_run_b_resume, WORLD, {"root": saved_runs, "tag": GATHER_TAG})


def test_changed_world_size_is_a_clear_error(saved_runs):
    run_on_ranks(_load_with_other_world, 4, {"root": saved_runs, "tag": PER_RANK_TAG})
    run_on_ranks(_load_with_other_world, 1, {"root": saved_runs, "tag": GATHER_TAG})
