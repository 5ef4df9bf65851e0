"""Exact resume with a real Megatron Energon loader: 2 gloo ranks, 2 loader workers each, a shuffle buffer.

Small WebDataset shards are written here and prepared offline with Energon's own ``energon prepare``. Run A
trains N+M steps with dropout and averaged gradients and saves at step N twice, with
``rank_state=loader, save_rng=True``: per-rank files and the gather-to-master file. Fresh processes build a new
model and a new ``get_savable_loader``, load each tag and train M steps: each rank's batches, its torch random
draws and its losses must equal run A's steps N+1..N+M bit for bit. (The rebuilt loader's first iteration draws
its workers' base seed from torch's global generator; nxd_ckpt keeps that draw from shifting the restored stream.)
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks

pytestmark = pytest.mark.device_independent  # the data loader's state: runs once, in the CPU lane

energon = pytest.importorskip("megatron.energon")

WORLD = 2
N_STEPS = 5
M_STEPS = 6
TAGS = {"per_rank": "step_5_per_rank", "gather": "step_5_gather"}


def make_dataset(root: str) -> str:
    """Two WebDataset shards of 40 text samples each, prepared with ``energon prepare`` (offline, no prompts)."""
    path = os.path.join(root, "wds")
    os.makedirs(path)
    for shard in range(2):
        with tarfile.open(os.path.join(path, f"shard_{shard:06d}.tar"), "w") as tar:
            for i in range(40):
                index = shard * 40 + i
                data = str(index).encode()
                info = tarfile.TarInfo(f"{index:06d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    energon_cli = os.path.join(os.path.dirname(sys.executable), "energon")
    command = [energon_cli] if os.path.exists(energon_cli) else [sys.executable, "-m", "megatron.energon.cli.main"]
    subprocess.run(
        [
            *command,
            "prepare",
            path,
            "--non-interactive",
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            "TextSample",
            "--field-map",
            '{"text": "txt"}',
            "--no-progress",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert os.path.exists(os.path.join(path, ".nv-meta", "dataset.yaml"))
    return path


def make_loader(data: str) -> energon.SavableDataLoader:
    rank = dist.get_rank()
    config = energon.WorkerConfig(rank=rank, world_size=WORLD, num_workers=2)
    dataset = energon.get_train_dataset(
        data, worker_config=config, batch_size=3, shuffle_buffer_size=12, max_samples_per_sequence=4
    )
    return energon.get_savable_loader(dataset, worker_config=config)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def features(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor([float(t) for t in texts])
    x = torch.stack([index / 80, (index % 7) / 7, (index % 3) / 3, torch.ones_like(index)], dim=1)
    return x, (index % 5).unsqueeze(1) / 5


def make_training() -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    model = Model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(model: Model, opt: torch.optim.Optimizer, batches: object, steps: int) -> list[dict]:
    """``steps`` DP steps (gradients averaged over the ranks); what each step saw and drew."""
    record = []
    for _ in range(steps):
        batch = next(batches)
        x, y = features(batch.text)
        draw = torch.rand(3)  # a plain draw from torch's global stream, besides dropout's
        loss = torch.nn.functional.mse_loss(model(x + 0.01 * draw.mean()), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        opt.step()
        record.append({"batch": list(batch.text), "draw": draw, "loss": loss.detach()})
    return record


def run_a(data: str, ckpt: str, out: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(99 + rank)  # each rank's own global stream (dropout masks differ per rank)
    model, opt = make_training()
    loader = make_loader(data)
    batches = iter(loader)
    before = train(model, opt, batches, N_STEPS)
    for mode, tag in TAGS.items():
        nxd.save_checkpoint(
            ckpt, tag, model=model, optimizer=opt, rank_state=loader, save_rng=True, rank_state_mode=mode
        )
    after = train(model, opt, batches, M_STEPS)
    torch.save({"before": before, "after": after}, os.path.join(out, f"a_{rank}.pt"))


def resume(data: str, ckpt: str, out: str) -> None:
    rank = dist.get_rank()
    for mode, tag in TAGS.items():
        torch.manual_seed(5)  # anything: the load restores the saved streams
        model, opt = make_training()
        loader = make_loader(data)
        nxd.load_checkpoint(ckpt, tag, model=model, optimizer=opt, rank_state=loader, allow_pickle=True)
        after = train(model, opt, iter(loader), M_STEPS)
        torch.save(after, os.path.join(out, f"{mode}_{rank}.pt"))


@pytest.mark.slow
def test_energon_savable_loader_resumes_exactly(tmp_path):
    data = make_dataset(str(tmp_path))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_on_ranks(run_a, WORLD, {"data": data, "ckpt": ckpt, "out": out}, timeout=400)
    run_on_ranks(resume, WORLD, {"data": data, "ckpt": ckpt, "out": out}, timeout=400)
    for rank in range(WORLD):
        reference = torch.load(os.path.join(out, f"a_{rank}.pt"))
        assert reference["before"][0]["batch"] != reference["after"][0]["batch"]
        for mode in TAGS:
            resumed = torch.load(os.path.join(out, f"{mode}_{rank}.pt"))
            for step, (want, got) in enumerate(zip(reference["after"], resumed, strict=True)):
                where = f"rank {rank}, {mode}, step {N_STEPS + step + 1}"
                assert got["batch"] == want["batch"], f"{where}: batches differ"
                assert torch.equal(got["draw"], want["draw"]), f"{where}: torch random draws differ"
                assert torch.equal(got["loss"], want["loss"]), (
                    f"{where}: losses differ ({got['loss']} != {want['loss']})"
                )
