"""Can the device->host transfer of an async save run on a background thread while training continues?

``xla.DeviceSnapshot`` takes on-device copies under one sync on the training thread; a second thread then
fetches them while the training thread keeps tracing, executing (with buffer donation) and syncing. This checks
the two things that could go wrong: the snapshot must hold exactly the values at snapshot time, and training
must be bit-identical to a run that never took snapshots. (The measurement is scripts/bench_xla_transfer.py.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nxd_ckpt import xla
from nxd_ckpt.testing.fakes import TinyMLP

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


class _Wide(torch.nn.Module):
    """A few MB of parameters so each background transfer takes long enough to overlap several steps."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6)))
        self.head = TinyMLP(d_in=256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layers(x)))


def _train(rounds: int, steps_per_round: int, snapshots: bool) -> tuple[list[float], list[tuple[list, list]]]:
    """Train; with ``snapshots`` take one every round and transfer it on a writer thread during the next steps."""
    device = torch_xla.device()
    torch.manual_seed(0)
    model = _Wide().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    checks: list[tuple[list, list]] = []
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transfer")
    pending = None
    try:
        for r in range(rounds):
            if snapshots:
                torch_xla.sync()
                tensors = [*model.state_dict().values()]
                tensors += [v for s in opt.state.values() for v in s.values() if v.device.type == "xla"]
                snapshot = xla.DeviceSnapshot(tensors)
                expected = xla.to_cpu(tensors)  # reference values at snapshot time, fetched synchronously
                if pending is not None:
                    checks.append(pending.result())
                pending = writer.submit(lambda s=snapshot, e=expected: (s.to_cpu(batch_bytes=1 << 20), e))
            for i in range(steps_per_round):
                g = torch.Generator().manual_seed(r * 1000 + i)
                x = torch.randn(32, 256, generator=g).to(device)
                y = torch.randn(32, 4, generator=g).to(device)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                torch_xla.sync()
                losses.append(float(loss.detach().cpu()))
        if pending is not None:
            checks.append(pending.result())
    finally:
        writer.shutdown(wait=True)
    return losses, checks


def test_background_transfer_of_device_snapshots_is_exact_and_does_not_disturb_training():
    control, _ = _train(rounds=8, steps_per_round=3, snapshots=False)
    losses, checks = _train(rounds=8, steps_per_round=3, snapshots=True)
    assert losses == control, "training with background transfers diverged from the control run"
    assert len(checks) == 8
    for r, (host, expected) in enumerate(checks):
        assert len(host) == len(expected)
        for got, want in zip(host, expected, strict=True):
            assert got.device.type == "cpu"
            assert torch.equal(got, want), f"round {r}: a snapshot changed while training continued"


def test_snapshot_is_single_use_and_rejects_non_xla_tensors():
    t = torch.ones(3).to(torch_xla.device())
    snapshot = xla.DeviceSnapshot([t])
    t.add_(1)  # in place on the original after the snapshot
    with ThreadPoolExecutor(max_workers=1) as pool:
        (host,) = pool.submit(snapshot.to_cpu).result()
    assert torch.equal(host, torch.ones(3)) and snapshot.nbytes == 12
    with pytest.raises(RuntimeError, match="already called"):
        snapshot.to_cpu()
    with pytest.raises(ValueError, match="XLA tensors only"):
        xla.DeviceSnapshot([torch.ones(3)])
