"""Which optimizer is behind the frameworks' wrappers, and whether it shards its state over DP ranks (ZeRO-1).

The one owner of both facts: a save decides ZeRO-1 here (``is_zero1_optimizer``), and the live-tensor, in-place
load and re-sharding paths reach the real optimizer through the same ``unwrap_optimizer``. Frameworks wrap the
optimizer a user built, each keeping it as ``.optimizer``, and nest in any order: accelerate's
``AcceleratedOptimizer`` (and optimum-neuron's ``NeuronAcceleratedOptimizer``, a subclass), Lightning's
``LightningOptimizer``, NxD's ``NxDOptimizer``. The state is read from and loaded into the innermost optimizer:
``LightningOptimizer.load_state_dict`` would load into the wrapper's own attributes and leave the real optimizer
as it was. Classes are looked up through
``sys.modules`` only, so nothing optional is imported here.
"""

from __future__ import annotations

import sys
from typing import Any

WRAPPER_CLASSES = (
    ("accelerate.optimizer", "AcceleratedOptimizer"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer"),
    ("neuronx_distributed.trainer.optimizer", "NxDOptimizer"),
)
"""Optimizer wrappers that hold the wrapped optimizer as ``.optimizer`` (subclasses count too)."""

WRAPPER_NAMES = frozenset({"NxDOptimizer"})
"""Wrappers also recognised by class name alone: NxD's, wherever its module was loaded from."""

ZERO1_CLASSES = (
    ("torch_xla.distributed.zero_redundancy_optimizer", "ZeroRedundancyOptimizer"),
    ("neuronx_distributed.optimizer.zero_redundancy_optimizer", "NeuronZero1Optimizer"),
)
"""Optimizers whose state is sharded over the DP ranks (NxD's ZeRO-1 and the torch_xla class it extends)."""

_MAX_DEPTH = 16
_registered_zero1: list[type] = []


def register_zero1_optimizer(cls: type) -> type:
    """Declare ``cls`` a ZeRO-1 optimizer (its state sharded over DP, with torch_xla's ``state_dict`` layout:
    ``base_state``, ``shape_info``), so saves recognise it as they recognise NxD's, through any wrapper. Returns
    ``cls``, so it can decorate the class."""
    if not isinstance(cls, type):
        raise TypeError(f"register_zero1_optimizer takes a class, got {type(cls).__name__}")
    if cls not in _registered_zero1:
        _registered_zero1.append(cls)
    return cls


def _loaded_classes(classes: tuple[tuple[str, str], ...]) -> list[type]:
    out = []
    for module_name, class_name in classes:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type):
            out.append(cls)
    return out


def is_instance_of_loaded(obj: Any, classes: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``obj`` is an instance of one of ``classes`` (``(module, class name)``) whose module is loaded."""
    return any(isinstance(obj, cls) for cls in _loaded_classes(classes))


def is_optimizer_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a known framework wrapper around another optimizer (held as ``.optimizer``)."""
    if obj is None or isinstance(obj, dict):
        return False
    if type(obj).__name__ in WRAPPER_NAMES or is_instance_of_loaded(obj, WRAPPER_CLASSES):
        inner = getattr(obj, "optimizer", None)
        return inner is not None and inner is not obj
    return False


def wrapper_chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and every optimizer inside it, outermost first (one element when it wraps nothing)."""
    chain = [optimizer]
    while is_optimizer_wrapper(chain[-1]) and len(chain) <= _MAX_DEPTH:
        chain.append(chain[-1].optimizer)
    return chain


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer that holds the state, inside every framework wrapper around it."""
    return wrapper_chain(optimizer)[-1]


def describe_chain(optimizer: Any) -> str:
    """The wrappers and the optimizer as a user reads them: ``NeuronAcceleratedOptimizer(NeuronZero1Optimizer)``."""
    names = [type(o).__name__ for o in wrapper_chain(optimizer)]
    return "".join(f"{n}(" for n in names[:-1]) + names[-1] + ")" * (len(names) - 1)


def is_zero1_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (through any wrappers) shards its state over DP ranks: by type (NxD's and torch_xla's
    ZeRO-1 classes, or one ``register_zero1_optimizer`` declared) or, for a state dict, by its layout."""
    if optimizer is None:
        return False
    opt = unwrap_optimizer(optimizer)
    if isinstance(opt, dict):
        return "base_state" in opt and "shape_info" in opt
    return is_instance_of_loaded(opt, ZERO1_CLASSES) or any(isinstance(opt, cls) for cls in _registered_zero1)
