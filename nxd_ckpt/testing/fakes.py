"""Small real models and helpers for tests and examples (no fakes of torch or torch_xla)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from nxd_ckpt import xla
from nxd_ckpt.tree import iter_tensors

TEST_DEVICE_ENV = "NXD_CKPT_TEST_DEVICE"


def lane_device() -> torch.device:
    """Where tests train by default: NXD_CKPT_TEST_DEVICE ('cpu' unless set; the XLA lane sets 'xla')."""
    resolved = xla.resolve_device(os.environ.get(TEST_DEVICE_ENV) or "cpu", TEST_DEVICE_ENV)
    assert resolved is not None
    return resolved


class TinyMLP(nn.Module):
    """A two-layer MLP with dropout; big enough to have several tensors, small enough to be instant."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_training(
    seed: int = 0, lr: float = 1e-2, dropout: float = 0.0, device: str | torch.device | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A seeded TinyMLP with AdamW and a StepLR schedule.

    ``device=None`` means ``lane_device()`` (the lane's device), except with dropout: ``torch.manual_seed`` does
    not seed XLA's generator (tests would need ``save_rng=True`` and ``xm.set_rng_state``), so dropout models stay
    on the CPU unless a device is given.
    """
    if device is None:
        device = lane_device() if dropout == 0.0 else torch.device("cpu")
    torch.manual_seed(seed)
    model = TinyMLP(dropout=dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    return model, opt, sched


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, seed: int) -> list[float]:
    """Run ``steps`` deterministic steps on synthetic data derived from ``seed``; return the losses."""
    losses = []
    device = next(model.parameters()).device
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(16, 8, generator=g).to(device)
        y = torch.randn(16, 4, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        model.steps_seen += 1
        if device.type == "xla":  # one graph per step, as a real XLA training loop does
            xla.require("training on XLA").sync()
        losses.append(float(loss.detach().cpu()))
    return losses


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of two nested states (tensors compared by dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{path}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"{path}: tensor values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def count_tensors(state: Any) -> int:
    return sum(1 for _ in iter_tensors(state))
