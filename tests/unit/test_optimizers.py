"""ZeRO-1 is recognised through every framework wrapper around the optimizer, with the frameworks' real classes:
accelerate's ``AcceleratedOptimizer`` (optimum-neuron's ``NeuronAcceleratedOptimizer`` subclasses it), Lightning's
``LightningOptimizer`` (both packages) and NxD's ``NxDOptimizer``, nested in any order."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from harness.zero1_adamw import Zero1AdamW
from nxd_ckpt import optimizers

accelerate_optimizer = pytest.importorskip("accelerate.optimizer", reason="accelerate is a test dependency")
lightning_optimizer = pytest.importorskip("lightning.pytorch.core.optimizer")
pl_optimizer = pytest.importorskip("pytorch_lightning.core.optimizer")


def _zero1() -> Zero1AdamW:
    return Zero1AdamW(torch.nn.Linear(4, 3).parameters())


def _accelerated(inner: object) -> object:
    return accelerate_optimizer.AcceleratedOptimizer(inner, device_placement=False)


class NeuronAcceleratedOptimizer(accelerate_optimizer.AcceleratedOptimizer):
    """optimum-neuron's wrapper is a subclass of accelerate's; a subclass is recognised as its base."""


WRAPS = {
    "accelerate": _accelerated,
    "optimum-neuron": lambda inner: NeuronAcceleratedOptimizer(inner, device_placement=False),
    "lightning": lambda inner: lightning_optimizer.LightningOptimizer(inner),
    "pytorch_lightning": lambda inner: pl_optimizer.LightningOptimizer(inner),
}


@pytest.mark.parametrize("framework", sorted(WRAPS))
def test_a_zero1_optimizer_is_recognised_through_each_frameworks_wrapper(framework):
    inner = _zero1()
    wrapped = WRAPS[framework](inner)
    assert optimizers.is_optimizer_wrapper(wrapped)
    assert optimizers.unwrap_optimizer(wrapped) is inner
    assert optimizers.is_zero1_optimizer(wrapped)


NESTINGS = [
    ("accelerate", "lightning"),
    ("lightning", "accelerate"),
    ("optimum-neuron", "pytorch_lightning"),
    ("pytorch_lightning", "optimum-neuron"),
]


@pytest.fixture(autouse=True)
def accelerator():
    """accelerate's wrappers need an ``Accelerator`` first, as in any accelerate program (optimum-neuron's trainer
    builds one); its process-wide state is reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("outer, middle", NESTINGS)
def test_nested_wrappers_are_unwrapped_in_any_order(outer, middle):
    inner = _zero1()
    wrapped = WRAPS[outer](WRAPS[middle](inner))
    assert optimizers.unwrap_optimizer(wrapped) is inner
    assert len(optimizers.wrapper_chain(wrapped)) == 3
    assert optimizers.is_zero1_optimizer(wrapped)


def test_the_optimizer_accelerate_prepares_is_unwrapped(accelerator):
    inner = _zero1()
    prepared = accelerator.prepare_optimizer(inner)
    assert isinstance(prepared, accelerate_optimizer.AcceleratedOptimizer)
    assert optimizers.unwrap_optimizer(prepared) is inner and optimizers.is_zero1_optimizer(prepared)


def test_a_plain_optimizer_in_wrappers_stays_plain_and_is_described_outermost_first():
    inner = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    wrapped = _accelerated(lightning_optimizer.LightningOptimizer(inner))
    assert optimizers.unwrap_optimizer(wrapped) is inner
    assert not optimizers.is_zero1_optimizer(wrapped)
    assert optimizers.describe_chain(wrapped) == "AcceleratedOptimizer(LightningAdamW(AdamW))"


def test_nxd_optimizer_wraps_by_its_module_or_its_name(monkeypatch):
    module = types.ModuleType("neuronx_distributed.trainer.optimizer")

    class NxDOptimizer(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    module.NxDOptimizer = NxDOptimizer
    monkeypatch.setitem(sys.modules, "neuronx_distributed.trainer.optimizer", module)
    inner = _zero1()
    assert optimizers.unwrap_optimizer(_accelerated(NxDOptimizer(inner))) is inner
    monkeypatch.delitem(sys.modules, "neuronx_distributed.trainer.optimizer")
    assert optimizers.unwrap_optimizer(NxDOptimizer(inner)) is inner  # NxD loaded from elsewhere: by name


def test_a_wrapper_nothing_knows_is_not_unwrapped():
    class HomeMadeWrapper:
        def __init__(self, optimizer: object) -> None:
            self.optimizer = optimizer

        def state_dict(self) -> dict:
            return self.optimizer.state_dict()

    wrapped = HomeMadeWrapper(_zero1())
    assert optimizers.unwrap_optimizer(wrapped) is wrapped
    assert not optimizers.is_zero1_optimizer(wrapped)  # the save's replica check refuses it (tests/distributed)


def test_nxd_and_torch_xla_zero1_classes_are_recognised_by_their_modules(monkeypatch):
    module = types.ModuleType("neuronx_distributed.optimizer.zero_redundancy_optimizer")

    class NeuronZero1Optimizer(torch.optim.AdamW):
        pass

    module.NeuronZero1Optimizer = NeuronZero1Optimizer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    opt = NeuronZero1Optimizer(torch.nn.Linear(2, 2).parameters())
    assert optimizers.is_zero1_optimizer(WRAPS["optimum-neuron"](opt))
    assert not optimizers.is_zero1_optimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))


def test_registering_a_zero1_class():
    class MyZero1(torch.optim.SGD):
        pass

    opt = MyZero1(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert not optimizers.is_zero1_optimizer(opt)
    assert optimizers.register_zero1_optimizer(MyZero1) is MyZero1
    assert optimizers.is_zero1_optimizer(_accelerated(opt))
    with pytest.raises(TypeError, match="takes a class"):
        optimizers.register_zero1_optimizer(opt)  # type: ignore[arg-type]


def test_a_state_dict_is_zero1_by_its_layout():
    assert optimizers.is_zero1_optimizer({"base_state": {}, "shape_info": {}, "param_groups": []})
    assert not optimizers.is_zero1_optimizer({"state": {}, "param_groups": []})
    assert not optimizers.is_zero1_optimizer(None)


def test_state_is_read_from_and_loaded_into_the_optimizer_inside_lightnings_wrapper():
    """``LightningOptimizer.load_state_dict`` would fill the wrapper's own attributes: the load goes inside."""
    from nxd_ckpt import adapters

    model = torch.nn.Linear(4, 3)
    source = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    source.step()
    target = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapped = lightning_optimizer.LightningOptimizer(target)
    adapters.load_optimizer_state(wrapped, adapters.optimizer_state(source), source="test")
    assert torch.equal(target.state[model.weight]["exp_avg"], source.state[model.weight]["exp_avg"])
    assert adapters.optimizer_state(wrapped)["state"][0]["step"] == 1
