"""ZeRO-1 behind the frameworks' optimizer wrappers, on real gloo DP ranks, with nothing told to the save.

optimum-neuron hands its trainer's optimizer to a save inside accelerate's ``AcceleratedOptimizer`` (its
``NeuronAcceleratedOptimizer`` subclass); Lightning users pass ``LightningOptimizer``. Each DP rank trains a real
sharded AdamW (``harness.zero1_adamw``, a registered ZeRO-1 class: each rank holds only its chunk of the moments),
saves it through the wrapper without ``zero1_optimizer``, and resumes into a fresh wrapped optimizer: every rank's
shard must come back bit-exact, the tag must be ZeRO-1 as NxD writes it (``zero1`` recorded, one optimizer file per
DP rank), and the offline converter and ``nxd-ckpt inspect`` must see ZeRO-1. A wrapper nothing knows is refused
before anything is written (the save would otherwise keep DP rank 0's shard only).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from harness.zero1_adamw import Zero1AdamW
from nxd_ckpt.cli import main as cli_main
from nxd_ckpt.format import layout
from nxd_ckpt.testing.fakes import TinyMLP
from nxd_ckpt.tools.convert_zero1 import convert_zero1

pytest.importorskip("accelerate", reason="accelerate is a test dependency (pyproject's test extra)")
pytest.importorskip("lightning")

WRAPPERS = ("accelerate", "lightning", "lightning-in-accelerate")
STEPS = 3


class HomeMadeWrapper:
    """A wrapper of the user's own, which nothing recognises (it keeps the optimizer under another name)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _wrap(kind: str, opt: Zero1AdamW) -> Any:
    from accelerate.optimizer import AcceleratedOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if kind == "accelerate":
        return AcceleratedOptimizer(opt)  # what accelerate's prepare (and optimum-neuron's trainer) hands over
    if kind == "lightning":
        return LightningOptimizer(opt)
    if kind == "lightning-in-accelerate":
        return AcceleratedOptimizer(LightningOptimizer(opt))
    return HomeMadeWrapper(opt)


def _setup(seed: int) -> tuple[torch.nn.Module, Zero1AdamW]:
    torch.manual_seed(seed)
    model = TinyMLP(d_hidden=10)
    return model, Zero1AdamW(model.parameters(), lr=2e-2, weight_decay=0.05)


def _train(model: torch.nn.Module, opt: Any, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)
        n = 12 // world
        loss = torch.nn.functional.mse_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _shard(opt: Zero1AdamW) -> dict[str, torch.Tensor]:
    """This rank's own part of the state: its moments and master weights (a clone)."""
    state = opt.state_dict()
    out = {f"master/{i}": t.clone() for i, t in state["sharded_master_weights"].items()}
    for i, entry in state["base_state"].items():
        out.update({f"{i}/{k}": v.clone() for k, v in entry.items()})
    return out


def _save_and_resume(root: str) -> None:
    from accelerate import Accelerator

    Accelerator(cpu=True)  # as any accelerate program does first (optimum-neuron's trainer builds one)
    world = dist.get_world_size()
    for kind in WRAPPERS:
        model, opt = _setup(seed=0)
        wrapped = _wrap(kind, opt)
        _train(model, wrapped if kind == "accelerate" else opt, STEPS)  # Lightning steps through its strategy
        saved = _shard(opt)
        assert saved["0/exp_avg"].shape[0] == -(-10 // world)  # a real shard: this rank's rows only
        nxd.save_checkpoint(os.path.join(root, kind), "step_3", model=model, optimizer=wrapped)
        fresh_model, fresh = _setup(seed=7)
        nxd.load_checkpoint(os.path.join(root, kind), "step_3", model=fresh_model, optimizer=_wrap(kind, fresh))
        resumed = _shard(fresh)
        assert sorted(resumed) == sorted(saved)
        for name, tensor in saved.items():
            assert torch.equal(resumed[name], tensor), f"{kind}: rank {dist.get_rank()}'s {name} differs"


def _refused(root: str, out: str) -> None:
    model, opt = _setup(seed=0)
    wrapped = _wrap("home-made", opt)
    _train(model, opt, 1)
    try:
        nxd.save_checkpoint(root, "step_1", model=model, optimizer=wrapped)
    except nxd.StateMismatchError as e:
        message = str(e)
    else:
        message = "no error"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


@pytest.mark.timeout(900)  # spawned jobs of 2 and 4 ranks; slow on a loaded 2-core machine
@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_behind_each_wrapper_is_saved_sharded_and_resumed_bit_exact(tmp_path, dp, capsys):
    root = str(tmp_path / "ckpt")
    run_on_ranks(_save_and_resume, dp, {"root": root}, timeout=600)
    for kind in WRAPPERS:
        folder = os.path.join(root, kind)
        meta = json.loads((tmp_path / "ckpt" / kind / "step_3" / "nxd_ckpt.json").read_text())
        assert meta["zero1"] is True and meta["zero1_dp_size"] == dp, kind
        optim = sorted(os.listdir(os.path.join(folder, "step_3", "optim")))
        assert optim == sorted(os.path.basename(layout.optim_file("step_3", dp_rank, 0, 0)) for dp_rank in range(dp)), (
            kind
        )  # one file per DP rank, named as NxD names them
        assert cli_main(["inspect", folder, "--tag", "step_3", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["layout"]["zero1"] is True and report["layout"]["dp"] == dp
        converted = convert_zero1(os.path.join(folder, "step_3"), str(tmp_path / "converted" / kind / "step_3"),
                                  dp_size=1)  # fmt: skip
        assert (converted.src_dp, converted.dst_dp) == (dp, 1)


@pytest.mark.timeout(600)
def test_a_wrapper_nothing_knows_around_sharded_state_is_refused_before_anything_is_written(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "messages.json")
    run_on_ranks(_refused, 2, {"root": root, "out": out})
    with open(out) as f:
        messages = json.load(f)
    for message in messages:  # every rank raises, naming both ranks, the optimizer and what to pass
        assert "differs between ranks 0 and 1" in message, message
        assert "HomeMadeWrapper" in message and "zero1_optimizer=True" in message
    assert not os.path.exists(os.path.join(root, "step_1")) and nxd.list_checkpoint_tags(root) == []
