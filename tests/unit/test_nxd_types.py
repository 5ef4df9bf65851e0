"""NxD's own types are recognised through ``sys.modules`` only: stand-in modules registered by these tests.

neuronx_distributed cannot be installed here (PyPI has a placeholder that refuses to import), so each test
registers a small module under NxD's real module path for its duration; nxd_ckpt must pick the classes up from
there by name, and must not recognise a look-alike class that was never registered.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import optimizers
from nxd_ckpt.testing.fakes import TinyMLP, assert_state_equal

PP_MODULE = "neuronx_distributed.pipeline.model"
ZERO1_MODULE = "neuronx_distributed.optimizer.zero_redundancy_optimizer"


class NxDPPModel(torch.nn.Module):
    """Stand-in for NxD's pipeline model: holds two stages, this rank owns only ``local``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.local = TinyMLP()
        self.other_stage = torch.nn.Linear(3, 3)

    def local_state_dict(self) -> dict:
        return self.local.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:  # type: ignore[override]
        self.local.load_state_dict(state, strict=strict)


class NeuronZero1Optimizer(torch.optim.AdamW):
    """Stand-in for NxD's ZeRO-1 optimizer (only its class identity matters to nxd_ckpt)."""


class NxDOptimizer:
    """Stand-in for NxD's wrapper, which keeps the real optimizer in ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _register(monkeypatch: pytest.MonkeyPatch, name: str, cls: type) -> None:
    module = types.ModuleType(name)
    setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, name, module)


def test_pipeline_model_saves_and_loads_only_its_local_state(monkeypatch, tmp_path):
    _register(monkeypatch, PP_MODULE, NxDPPModel)
    model = NxDPPModel()
    nxd.save_checkpoint(str(tmp_path), "pp", model=model)
    saved = torch.load(tmp_path / "pp" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert set(saved) == set(model.local.state_dict())  # the other stage is not this rank's to save
    fresh = NxDPPModel()
    with torch.no_grad():
        fresh.local.fc1.weight.add_(1.0)
    nxd.load_checkpoint(str(tmp_path), "pp", model=fresh)
    assert_state_equal(fresh.local.state_dict(), model.local.state_dict())


def test_unregistered_look_alike_is_an_ordinary_module(tmp_path):
    assert PP_MODULE not in sys.modules
    model = NxDPPModel()
    nxd.save_checkpoint(str(tmp_path), "plain", model=model)
    saved = torch.load(tmp_path / "plain" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert set(saved) == set(model.state_dict())  # full state_dict: the name alone is not trusted
    assert not optimizers.is_zero1_optimizer(NeuronZero1Optimizer(TinyMLP().parameters()))


def test_neuron_zero1_optimizer_is_recognised_directly_and_inside_nxd_optimizer(monkeypatch, tmp_path):
    _register(monkeypatch, ZERO1_MODULE, NeuronZero1Optimizer)
    model = TinyMLP()
    zero1 = NeuronZero1Optimizer(model.parameters(), lr=1e-2)
    assert optimizers.is_zero1_optimizer(zero1)
    assert optimizers.is_zero1_optimizer(NxDOptimizer(zero1))
    model(torch.randn(2, 8)).sum().backward()
    zero1.step()
    nxd.save_checkpoint(str(tmp_path), "z", model=model, optimizer=NxDOptimizer(zero1))
    meta = json.loads((tmp_path / "z" / "nxd_ckpt.json").read_text())
    assert meta["zero1"] is True
    restored = NeuronZero1Optimizer(model.parameters(), lr=1e-2)
    nxd.load_checkpoint(str(tmp_path), "z", model=model, optimizer=NxDOptimizer(restored))
    assert_state_equal(restored.state_dict(), zero1.state_dict())
