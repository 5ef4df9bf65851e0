"""Two spawned ranks, each with its own XLA CPU device, under an ``xla``-backend default group (as on Neuron).

XLA collectives are silently local on XLA:CPU, so nxd_ckpt must coordinate over a gloo group it creates itself
and exchange only CPU objects; the checkpoint must still be one consistent, complete tag.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness import rendezvous
from harness.multiprocess import run_with_ranks
from harness.xla_metrics import xla_graph_compiles
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla bash scripts/run_tests.sh)"

pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


def _reinit_with_xla_backend() -> None:
    """Replace the harness's gloo default group with torch_xla's ``xla`` backend over the same ranks (meeting
    again at the harness's store, under a prefix of their own)."""
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    port = int(os.environ["MASTER_PORT"])
    rendezvous.init_process_group(port, rank, world, backend="xla", prefix="xla_group/")


@run_with_ranks(2)
def test_xla_default_group_save_load_over_library_gloo_group(tmp_path):
    import torch_xla

    _reinit_with_xla_backend()
    assert dist.get_backend() == "xla"
    nxd.reset_manager()
    coord = nxd.get_manager().coordinator()
    assert coord.world_size == 2 and dist.get_backend(coord.group) == "gloo"
    device = torch_xla.device()
    assert str(device) == "xla:0"  # every process has its own xla:0

    model, opt, sched = make_training(seed=1, device=device)  # DP replicas start equal
    train_steps(model, opt, sched, 2, seed=1)
    with pytest.raises(ValueError, match="only CPU tensors"):
        coord.broadcast_tensor(model.fc1.weight.detach(), src=0, group=coord.group)  # never XLA over gloo
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(ckpt, "step_2", model=model, optimizer=opt, scheduler=sched, user_content={"ranks": 2})
    assert os.path.exists(os.path.join(ckpt, "step_2", "done"))
    reference = train_steps(model, opt, sched, 2, seed=2)

    model2, opt2, sched2 = make_training(seed=5, device=device)
    assert nxd.load_checkpoint(ckpt, model=model2, optimizer=opt2, scheduler=sched2) == {"ranks": 2}
    assert {t.device.type for t in model2.state_dict().values()} == {"xla"}
    assert opt2.state_dict()["state"][0]["exp_avg"].device == device
    assert train_steps(model2, opt2, sched2, 2, seed=2) == reference
    assert_state_equal(model2.state_dict(), model.state_dict())
    losses = coord.all_gather_object(reference)  # CPU objects over gloo: both replicas trained identically
    assert losses[0] == losses[1]
    assert isinstance(losses[0][0], float) and not isinstance(losses[0][0], torch.Tensor)


def _wide_training(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Model + AdamW of shapes no other test uses, one step trained (the same on both DP replicas)."""
    import torch_xla

    torch.manual_seed(width)
    device = torch_xla.device()
    layers = [torch.nn.Linear(width, width) for _ in range(6)]  # weights over the 64 KiB inline limit: tensor files
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, width, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()
    return model, opt


def _async_save_compiles(ckpt: str, tag: str, model, opt) -> int:
    before = xla_graph_compiles()
    report = nxd.save_checkpoint(ckpt, tag, model=model, optimizer=opt, use_xser=True, async_save=True)
    compiled = xla_graph_compiles() - before
    report.wait()
    return compiled


@run_with_ranks(2)
def test_dp_replicas_take_their_xser_share_of_the_snapshot_ahead_and_the_first_save_compiles_nothing(tmp_path):
    nxd.reset_manager()
    ckpt = str(tmp_path / "ckpt")
    model, opt = _wide_training(160)
    before = xla_graph_compiles()
    nxd.prepare_async_save(model=model, optimizer=opt, use_xser=True)
    assert xla_graph_compiles() - before == 1  # this rank's share: the graph its save takes
    assert _async_save_compiles(ckpt, "prepared", model, opt) == 0
    control, control_opt = _wide_training(176)  # no prepare_async_save: the first save compiles its snapshot
    assert _async_save_compiles(ckpt, "control", control, control_opt) == 1
    nxd.finalize_checkpoint()
    assert os.path.exists(os.path.join(ckpt, "prepared", "done"))
