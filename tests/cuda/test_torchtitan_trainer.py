"""TorchTitan's real ``Trainer`` with this library's checkpoint manager, selected by the job's ``checkpoint``
config (``harness.titan_trainer``): the llama3 debug model trains a few steps under torchrun with saves, is killed
right after a save, resumes, and the losses after the resume equal the uninterrupted run's, in ``sync`` and
``async`` modes.

The trainer needs a GPU (``torchtitan.tools.utils`` picks ``cuda`` on a CPU-only machine, and importing it needs
triton): those tests are skipped where torch sees none, with the reason. What runs anywhere: the job's config goes
through TorchTitan's own config system (``ConfigManager``, tyro's overrides on the command line) to this
library's manager, built with the trainer's keyword arguments, and the job's tokenizer and data set load through
TorchTitan's own tokenizer and data loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]', Python >= 3.11)"
)

from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.config import ConfigManager

from harness import titan_trainer
from nxd_ckpt.cli import main as nxd_ckpt_cli
from nxd_ckpt.torchtitan import CheckpointManager

pytestmark = pytest.mark.device_independent  # the trainer's device is the GPU whatever the lane: runs once

REPO = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(
    GPUS == 0,
    reason="TorchTitan's Trainer needs an accelerator: torch sees no GPU here (torchtitan.tools.utils would pick "
    "cuda anyway), so the real-trainer run is skipped",
)
KILL_AFTER_SAVE_STEP = 6
"""The crashed run is killed right after the save of step 6 returned (step-4 is complete; step-6 may be in flight
in async mode)."""


def _trainer_args(dump: Path, assets: tuple[str, str], async_mode: str, **extra: object) -> list[str]:
    """The job's command line after ``-m torchtitan.train``: TorchTitan's --module/--config and overrides."""
    tokenizer, data = assets
    args = [
        "--module", "harness.titan_trainer", "--config", "nxd_ckpt_llama3_debugmodel",
        "--dump_folder", str(dump), "--hf_assets_path", tokenizer, "--dataloader.dataset_path", data,
        "--checkpoint.async_mode", async_mode, "--losses_file", str(dump / "losses.jsonl"),
    ]  # fmt: skip
    for key, value in extra.items():
        args += [f"--{key}", str(value)]
    return args


def _run_job(dump: Path, assets: tuple[str, str], async_mode: str, **extra: object) -> subprocess.CompletedProcess:
    """One torchrun of TorchTitan's own entry point (``python -m torchtitan.train``) on up to 2 GPUs (FSDP2
    shards the state over them)."""
    dump.mkdir(parents=True, exist_ok=True)
    nproc = min(GPUS, 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "torchtitan.train", *_trainer_args(dump, assets, async_mode, **extra)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_DATASETS_CACHE": str(dump / "hf_cache"),
        "HF_DATASETS_OFFLINE": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS (debug.deterministic)
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    (dump / "torchrun.log").write_text(proc.stdout + proc.stderr)
    return proc


def _losses(dump: Path) -> dict[int, float]:
    lines = (dump / "losses.jsonl").read_text().splitlines() if (dump / "losses.jsonl").exists() else []
    out: dict[int, float] = {}
    for line in lines:
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


@needs_gpu
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_the_real_trainer_killed_after_a_save_resumes_to_the_same_losses(tmp_path, async_mode):
    assets = titan_trainer.write_assets(str(tmp_path / "assets"))
    reference = tmp_path / "reference"
    proc = _run_job(reference, assets, async_mode)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    expected = _losses(reference)
    steps = titan_trainer.DEFAULT_STEPS
    assert sorted(expected) == list(range(1, steps + 1)), expected
    assert len(set(expected.values())) > 1, f"the loss never changed: nothing was trained ({expected})"

    run = tmp_path / "run"
    crashed = _run_job(run, assets, async_mode, kill_after_save_step=KILL_AFTER_SAVE_STEP)
    assert crashed.returncode != 0, "the run was to be killed after the save of step 6"
    assert sorted(_losses(run)) == list(range(1, KILL_AFTER_SAVE_STEP + 1))
    (run / "losses.jsonl").rename(run / "losses_before_the_kill.jsonl")

    resumed = _run_job(run, assets, async_mode)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    after = _losses(run)
    first = min(after)
    # the newest complete step: step-4, or step-6 when its (async) save finished before the kill
    assert first - 1 in (KILL_AFTER_SAVE_STEP - titan_trainer.DEFAULT_INTERVAL, KILL_AFTER_SAVE_STEP), after
    assert sorted(after) == list(range(first, steps + 1))
    for step, loss in after.items():
        # deterministic kernels, same data order: equal up to float rounding of nondeterministic reductions
        # (a lost optimizer, scheduler or data-loader state moves the loss by orders of magnitude more)
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=0), (step, loss, expected[step])
    assert nxd_ckpt_cli(["verify", str(run / "checkpoint" / f"step-{steps}")]) == 0


def test_the_job_config_selects_this_manager_through_torchtitans_config_system(tmp_path, monkeypatch):
    """TorchTitan's ConfigManager (tyro) parses the job's ``--checkpoint.*`` overrides into this library's
    ``CheckpointManager.Config``, declared as the trainer declares its field (``checkpoint:
    BaseCheckpointManager.Config``), and ``build`` with the trainer's keyword arguments gives this manager.
    (The trainer's own Config needs the trainer's import: the module below declares the same field.)"""
    module = tmp_path / "titan_job_config.py"
    module.write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass, field

            from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
            from torchtitan.config import Configurable

            from harness import titan_trainer


            @dataclass(kw_only=True, slots=True)
            class JobConfig(Configurable.Config):
                hf_assets_path: str = "."
                dump_folder: str = "./outputs"
                checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


            def job():
                return JobConfig(checkpoint=titan_trainer.checkpoint_config())
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--module", "titan_job_config", "--config", "job", "--hf_assets_path", str(tmp_path),
            "--checkpoint.async_mode", "async", "--checkpoint.interval", "3",
            "--checkpoint.timeout_s", "120"]  # fmt: skip
    config = ConfigManager().parse_args(args)
    ckpt = config.checkpoint
    assert type(ckpt) is CheckpointManager.Config and isinstance(ckpt, BaseCheckpointManager.Config)
    assert (ckpt.enable, ckpt.folder, ckpt.interval, ckpt.async_mode, ckpt.timeout_s) == (
        True, "checkpoint", 3, "async", 120.0,
    )  # fmt: skip
    from harness import titan_job

    with titan_job.gloo_world_of_one():
        job = titan_job.TitanJob(ckpt, seed=0, base_folder=str(tmp_path / "dump"))
        try:
            assert type(job.checkpointer) is CheckpointManager
            job.train(3)
            job.checkpointer.maybe_wait_for_saving()
        finally:
            job.checkpointer.close()
    assert (tmp_path / "dump" / "checkpoint" / "step-3" / ".metadata").exists()


def test_the_jobs_tokenizer_and_data_load_through_torchtitans_own_classes(tmp_path):
    """The assets the trainer test hands ``--hf_assets_path`` and ``--dataloader.dataset_path``: TorchTitan's
    ``HuggingFaceTokenizer`` reads them, and its ``HuggingFaceTextDataLoader`` (the debug job's ``c4_test``
    processing) yields batches of the job's shape with ids inside the debug model's vocabulary, offline."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    tokenizer_dir, data_dir = titan_trainer.write_assets(str(tmp_path / "assets"), documents=40)
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=tokenizer_dir)
    assert tokenizer.bos_id == 1 and tokenizer.eos_id == 2
    assert tokenizer.encode("w0 w7", add_bos=True, add_eos=True) == [1, 3, 10, 2]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    loader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data_dir).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=128, local_batch_size=2, snapshot_every_n_steps=2
    )
    batches = iter(loader)
    for _ in range(2):
        inputs, labels = next(batches)
        assert inputs["input"].shape == labels.shape == (2, 128)
        assert int(inputs["input"].max()) < 2048 and int(labels.min()) >= 0
    state = loader.state_dict()  # what the manager saves as the "dataloader" entry
    third = next(batches)
    resumed = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data_dir).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=128, local_batch_size=2, snapshot_every_n_steps=2
    )
    resumed.load_state_dict(state)
    inputs, labels = next(iter(resumed))
    assert torch.equal(inputs["input"], third[0]["input"]) and torch.equal(labels, third[1])
