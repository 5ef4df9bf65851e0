"""A small TorchTitan job for tests of ``nxd_ckpt.torchtitan.CheckpointManager`` in other processes and on other
storage: a model, TorchTitan's real optimizer and LR-scheduler containers, a train state, and the manager built
from its Config as TorchTitan's trainer builds it. Needs the ``torchtitan`` extra (imported on use)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class TrainState:
    """The trainer's own state entry (TorchTitan passes ``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


class TitanJob:
    """A model (the same on every rank: data parallel), TorchTitan's optimizer and LR-scheduler containers, and
    the checkpoint manager built from ``config`` with the trainer's keyword arguments."""

    def __init__(self, config: Any, seed: int, base_folder: str = "") -> None:
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        torch.manual_seed(seed)
        self.model = torch.nn.Linear(32, 16)
        self.optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=20
        )
        self.train_state = TrainState()
        self.checkpointer = config.build(
            dataloader=TrainState(),
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=base_folder,
        )

    def train(self, steps: int, after_save: Any = None) -> None:
        """``steps`` steps, a ``save`` after each as TorchTitan's trainer calls it (then ``after_save(self)``)."""
        for _ in range(steps):
            gen = torch.Generator().manual_seed(100 + self.train_state.step)
            self.model(torch.randn(2, 32, generator=gen)).square().mean().backward()
            finish_step(self)
            self.checkpointer.save(self.train_state.step)
            if after_save is not None:
                after_save(self)

    def state(self) -> dict[str, Any]:
        """Model and optimizer state and the step, cloned."""
        optim = self.optimizers.state_dict()
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim.items()},
            "step": self.train_state.step,
        }


def assert_same_state(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Two ``TitanJob.state`` results are bit-identical."""
    assert got["step"] == expected["step"], (got["step"], expected["step"])
    for part in ("model", "optim"):
        assert expected[part].keys() == got[part].keys(), part
        for key, value in expected[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[part][key]), key
            else:
                assert value == got[part][key], key


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """One gloo rank over a HashStore (no port), as a one-GPU TorchTitan job has one rank: DCP and the manager run
    as there."""
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP: "assuming the intent is to save in a single process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def finish_step(job: Any) -> None:
    """The rest of a training step once ``job``'s backward ran, as TorchTitan's trainer takes it: gradients averaged
    over the ranks' replicas, the manager's staging waited for, then the optimizer and LR steps and the step count
    (``job`` has ``model``, ``checkpointer``, ``optimizers``, ``lr_schedulers`` and ``train_state``)."""
    if dist.is_initialized() and dist.get_world_size() > 1:  # data parallel: every replica takes the same step
        for p in job.model.parameters():
            dist.all_reduce(p.grad)
    job.checkpointer.maybe_wait_for_staging()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.optimizers.zero_grad()
    job.train_state.step += 1
