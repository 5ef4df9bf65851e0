"""Getting state out of, and back into, the objects users pass: modules, optimizers, schedulers, plain dicts.

NxD's own types (``NxDPPModel``, ``NeuronZero1Optimizer``) and torch_xla's ``ZeroRedundancyOptimizer`` are
recognised by class name through ``sys.modules`` only, so nothing optional is ever imported here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from . import xla
from .errors import StateMismatchError
from .tree import EXPERT_ATTR

ZERO1_CLASSES = (
    ("torch_xla.distributed.zero_redundancy_optimizer", "ZeroRedundancyOptimizer"),
    ("neuronx_distributed.optimizer.zero_redundancy_optimizer", "NeuronZero1Optimizer"),
)
PP_MODEL_CLASSES = (("neuronx_distributed.pipeline.model", "NxDPPModel"),)


def _is_instance_of_loaded(obj: Any, classes: tuple[tuple[str, str], ...]) -> bool:
    for module_name, class_name in classes:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type) and isinstance(obj, cls):
            return True
    return False


def _unwrap_optimizer(optimizer: Any) -> Any:
    """NxD's ``NxDOptimizer`` wraps the real optimizer in ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    if type(optimizer).__name__ == "NxDOptimizer" and inner is not None:
        return inner
    return optimizer


def is_zero1_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` shards its state across DP ranks (ZeRO-1), recognised by type or state layout."""
    if optimizer is None:
        return False
    opt = _unwrap_optimizer(optimizer)
    if _is_instance_of_loaded(opt, ZERO1_CLASSES):
        return True
    if isinstance(opt, dict):
        return "base_state" in opt and "shape_info" in opt
    return False


def model_state(model: Any) -> Any:
    """The state to save for a model: a dict as is, NxD's pipeline model's local part, or ``state_dict()``."""
    if isinstance(model, dict):
        return model
    if _is_instance_of_loaded(model, PP_MODEL_CLASSES) and hasattr(model, "local_state_dict"):
        return _mark_experts(model, model.local_state_dict())
    return _mark_experts(model, _state_dict_of(model, "model"))


def _mark_experts(model: Any, state: Any) -> Any:
    """Carry NxD's ``expert_model_parallel`` mark from a model's parameters to the tensors of its state dict
    (``state_dict()`` returns detached tensors without it), so xser info files record expert tensors as NxD's do."""
    named = getattr(model, "named_parameters", None)
    if not callable(named) or not isinstance(state, dict):
        return state
    for name, param in named():
        value = state.get(name)
        if getattr(param, EXPERT_ATTR, False) and isinstance(value, torch.Tensor):
            setattr(value, EXPERT_ATTR, True)
    return state


def optimizer_state(optimizer: Any) -> Any:
    return optimizer if isinstance(optimizer, dict) else _state_dict_of(optimizer, "optimizer")


def scheduler_state(scheduler: Any) -> Any:
    return scheduler if isinstance(scheduler, dict) else _state_dict_of(scheduler, "scheduler")


def _state_dict_of(obj: Any, role: str) -> Any:
    fn = getattr(obj, "state_dict", None)
    if not callable(fn):
        raise TypeError(f"{role} must be a dict or have state_dict()/load_state_dict(); got {type(obj).__name__}")
    return fn()


def _fill_dict(target: dict, state: Any, role: str, device: torch.device | None = None) -> None:
    """Replace ``target``'s contents with ``state``; tensors stay on the CPU unless ``device`` is given."""
    if not isinstance(state, dict):
        raise StateMismatchError(f"saved {role} state is a {type(state).__name__}, cannot fill a dict with it")
    if device is not None:
        state = xla.place_tree(state, device)
    target.clear()
    target.update(state)


def load_model_state(model: Any, state: Any, *, strict: bool, source: str, device: torch.device | None = None) -> None:
    """Load ``state`` into ``model``, checking keys (under ``strict``) and shapes first with clear errors.

    A model on an XLA device gets the state moved there in bulk first and materialised with one sync after;
    ``device`` applies to dict targets only (objects keep the device they live on).
    """
    if isinstance(model, dict):
        _fill_dict(model, state, "model", device)
        return
    current = model_state(model)
    target_device = xla.tree_device(current)
    if target_device is not None:
        state = xla.place_tree(state, target_device)
    if _is_instance_of_loaded(model, PP_MODEL_CLASSES) and hasattr(model, "load_state_dict"):
        model.load_state_dict(state, strict=strict)
    else:
        if isinstance(model, torch.nn.Module):
            check_model_state(current, state, strict=strict, source=source)
        try:
            model.load_state_dict(state, strict=strict)
        except RuntimeError as e:
            raise StateMismatchError(f"loading {source} into the model failed: {e}") from e
    if target_device is not None:
        xla.sync_tree(model_state(model))


def check_model_state(expected: dict, saved: Any, *, strict: bool, source: str) -> None:
    """Raise StateMismatchError naming missing/unexpected keys and shape mismatches."""
    if not isinstance(saved, dict):
        raise StateMismatchError(f"{source} holds a {type(saved).__name__}, not a model state dict")
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_short(unexpected)}")
        raise StateMismatchError(
            f"{source} does not match the model: {'; '.join(parts)}. Pass strict=False to load only the matching keys."
        )
    bad = []
    for key, value in expected.items():
        got = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape != value.shape:
            bad.append(f"{key}: saved {tuple(got.shape)}, model {tuple(value.shape)}")
    if bad:
        raise StateMismatchError(f"{source} has shapes that do not match the model: {_short(bad)}")


def load_optimizer_state(optimizer: Any, state: Any, *, source: str, device: torch.device | None = None) -> None:
    """Load ``state`` into ``optimizer``; the optimizer itself moves state to its parameters' devices."""
    if isinstance(optimizer, dict):
        _fill_dict(optimizer, state, "optimizer", device)
        return
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise StateMismatchError(f"loading {source} into the optimizer failed: {e}") from e
    if xla.loaded() is not None:
        xla.sync_tree(optimizer.state_dict())


def load_scheduler_state(scheduler: Any, state: Any, *, source: str, device: torch.device | None = None) -> None:
    if isinstance(scheduler, dict):
        _fill_dict(scheduler, state, "scheduler", device)
        return
    scheduler.load_state_dict(state)


def _short(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(i) if "'" not in i and ":" not in i else i for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"
