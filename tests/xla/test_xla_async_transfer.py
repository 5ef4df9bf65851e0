"""Can the device->host transfer of an async save run on a background thread while training continues?

``device.snapshot.take`` takes on-device copies under one sync on the training thread; a second thread then
fetches them while the training thread keeps tracing, executing (with buffer donation) and syncing. This checks
the two things that could go wrong: the snapshot must hold exactly the values at snapshot time, and training
must be bit-identical to a run that never took snapshots. (The measurement is python -m benchmarks xla_transfer.)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nxd_ckpt import xla
from nxd_ckpt.device import snapshot as device_snapshot
from nxd_ckpt.device.backend import SnapshotBudget
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


def _fetch_all(snapshot: device_snapshot.Snapshot, tensors: list, expected: list) -> tuple[list, list]:
    """On a writer thread: every host copy as it arrives from the snapshot's transfer thread."""
    host = [snapshot.transfer.host(snapshot.stand_ins[id(t)]) for t in tensors]
    snapshot.transfer.close()
    return host, expected


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
                snapshot = device_snapshot.take(tensors, SnapshotBudget(None), chunk_bytes=1 << 20)
                expected = xla.to_cpu(tensors)  # reference values at snapshot time, fetched synchronously
                if pending is not None:
                    checks.append(pending.result())
                pending = writer.submit(_fetch_all, snapshot, tensors, expected)
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


def test_a_snapshot_holds_the_values_of_its_call_and_takes_device_tensors_only():
    t = torch.ones(3).to(torch_xla.device())
    snapshot = device_snapshot.take([t], SnapshotBudget(None))
    t.add_(1)  # in place on the original after the snapshot
    torch_xla.sync()
    with ThreadPoolExecutor(max_workers=1) as pool:
        (host,), _ = pool.submit(_fetch_all, snapshot, [t], []).result()
    assert torch.equal(host, torch.ones(3)) and snapshot.snapshot_bytes == 12
    with pytest.raises(ValueError, match="device tensors only"):
        device_snapshot.take([torch.ones(3)], SnapshotBudget(None))
