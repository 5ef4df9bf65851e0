"""Getting state out of, and back into, the objects users pass: modules, optimizers, schedulers, plain dicts.

NxD's own types (``NxDPPModel``) are recognised through ``sys.modules`` only, so nothing optional is ever imported
here; which optimizer is behind a framework's wrappers, and whether it is ZeRO-1, is ``optimizers``' to say.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nxd_ckpt import optimizers, xla
from nxd_ckpt.device.backend import on_device
from nxd_ckpt.device.load_targets import DeviceLoadTarget, LoadTarget, device_loads_enabled
from nxd_ckpt.errors import StateMismatchError
from nxd_ckpt.tree import EXPERT_ATTR, iter_tensors

logger = logging.getLogger("nxd_ckpt")

PP_MODEL_CLASSES = (("neuronx_distributed.pipeline.model", "NxDPPModel"),)


def model_state(model: Any) -> Any:
    """The state to save for a model: a dict as is, NxD's pipeline model's local part, or ``state_dict()``."""
    if isinstance(model, dict):
        return model
    if optimizers.is_instance_of_loaded(model, PP_MODEL_CLASSES) and hasattr(model, "local_state_dict"):
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
    """The state to save for an optimizer: a dict as is, else the state dict of the optimizer inside any framework
    wrappers (``optimizers.unwrap_optimizer``)."""
    return (
        optimizer
        if isinstance(optimizer, dict)
        else _state_dict_of(optimizers.unwrap_optimizer(optimizer), "optimizer")
    )


def live_tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The model's and optimizer's own tensors (parameters, buffers, optimizer state), without building a state dict
    (which would make new XLA tensors over the same values)."""
    out: list[torch.Tensor] = []
    if isinstance(model, torch.nn.Module):
        out += list(model.parameters()) + list(model.buffers())
    elif model is not None:
        out += [t for _, t in iter_tensors(model_state(model))]
    inner = optimizers.unwrap_optimizer(optimizer) if optimizer is not None else None
    holders = [inner, getattr(inner, "base_optimizer", None)] if inner is not None else []  # ZeRO-1: the shards'
    for holder in holders:
        for group in getattr(holder, "state", {}).values() if holder is not None else ():
            out += [t for _, t in iter_tensors(group)]
    return out


def run_pending_step(model: Any, optimizer: Any) -> bool:
    """Before a save reads the state: run its pending XLA graph once (``xla.run_pending_step``), so the save and
    the user's later sync do not each run the step; whether there was one."""
    return xla.run_pending_step(live_tensors(model, optimizer))


def scheduler_state(scheduler: Any) -> Any:
    return scheduler if isinstance(scheduler, dict) else _state_dict_of(scheduler, "scheduler")


def _state_dict_of(obj: Any, role: str) -> Any:
    fn = getattr(obj, "state_dict", None)
    if not callable(fn):
        raise TypeError(f"{role} must be a dict or have state_dict()/load_state_dict(); got {type(obj).__name__}")
    return fn()


def load_target(obj: Any, role: str, *, strict: bool = True, source: str = "") -> LoadTarget | None:
    """The existing tensors a load of ``role`` ("model"/"optimizer") into ``obj`` reads straight into: a
    module's parameters and buffers (the objects themselves, so device tensors can take new data in place), an
    optimizer's state tensors, a dict's tensors. None when ``obj`` holds no tensor yet (fresh dicts, fresh
    optimizers): those loads read into fresh memory as before. Device tensors make it a ``DeviceLoadTarget``
    (bounded host buffers streamed to the device), unless NXD_CKPT_XLA_TRANSFER_THREAD=0 keeps transfers off the
    reader threads (then device targets are placed after the read, as before)."""
    check = None
    current: Any = None
    if role == "model" and not isinstance(obj, dict):
        current = model_state(obj)
        tree = dict(current)
        if isinstance(obj, torch.nn.Module):
            live = dict(obj.named_parameters(remove_duplicate=False))
            live.update(obj.named_buffers(remove_duplicate=False))
            tree = {k: live.get(k, v) if isinstance(v, torch.Tensor) else v for k, v in current.items()}
            if not optimizers.is_instance_of_loaded(obj, PP_MODEL_CLASSES):
                # Shapes only: holding the state dict's tensors would keep old device buffers alive all load.
                expected = {k: _shape_only(v) for k, v in current.items()}

                def check(meta: Any) -> None:
                    check_model_state(expected, meta, strict=strict, source=source)

    elif role == "optimizer" and not isinstance(obj, dict):
        tree = optimizer_state(obj)
    else:
        tree = obj
    del current
    tensors = [t for _, t in iter_tensors(tree)]
    if not tensors:
        return None
    if any(on_device(t) for t in tensors) and device_loads_enabled():
        return DeviceLoadTarget(tree, check)
    return LoadTarget(tree, check)


def holds_device_tensors(obj: Any, role: str) -> bool:
    """Whether a load of ``role`` ("model"/"optimizer") into ``obj`` fills tensors off the host (XLA): such a
    load stages through host buffers of its own (``device.load_targets.DeviceLoadTarget``)."""
    if obj is None:
        return False
    tree = obj if isinstance(obj, dict) else model_state(obj) if role == "model" else optimizer_state(obj)
    return any(t.device.type not in ("cpu", "meta") for _, t in iter_tensors(tree))


def meta_tensor_names(state: Any) -> list[str]:
    """Paths of tensors on the ``meta`` device (shape only, no data) in a state."""
    from nxd_ckpt.tree import iter_tensors

    return [path for path, t in iter_tensors(state) if t.device.type == "meta"]


def refuse_meta_for_save(state: Any, role: str) -> None:
    """A state with ``meta`` tensors has no data to save: say so instead of failing deep in serialization."""
    names = meta_tensor_names(state)
    if names:
        raise StateMismatchError(
            f"cannot save the {role}: {len(names)} tensor(s) are on the 'meta' device and hold no data "
            f"(e.g. {names[0]!r}); materialise it first (model.to_empty(device=...) then initialise or load weights)"
        )


def _check_target_device(obj: Any, state: Any, device: torch.device | None, role: str) -> None:
    """``device=`` places tensors for dict targets only; a module/optimizer keeps its own device, so a different
    one asked for is an error rather than silently ignored."""
    if device is None:
        return
    from nxd_ckpt.tree import iter_tensors

    devices = {t.device for _, t in iter_tensors(state)}
    for have in devices:
        if have.type != device.type or (device.index is not None and have.index != device.index):
            raise ValueError(
                f"device={str(device)!r} applies to dict targets only; this {role} lives on {have}. Move it there "
                f"first ({role}.to({str(device)!r}) for a module) and load without device=, or pass a dict"
            )


def _shape_only(value: Any) -> Any:
    return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value


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
    if meta_tensor_names(current):
        raise StateMismatchError(
            f"cannot load {source} into a model on the 'meta' device (its tensors hold no memory, so nothing "
            "would be loaded); create it on a real device, or call model.to_empty(device='cpu') first"
        )
    _check_target_device(model, current, device, "model")
    target_device = xla.tree_device(current)
    if target_device is not None:
        state = xla.place_tree(state, target_device)
    if optimizers.is_instance_of_loaded(model, PP_MODEL_CLASSES) and hasattr(model, "load_state_dict"):
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
    if not strict and expected and saved and not (set(expected) & set(saved)):
        raise StateMismatchError(
            f"{source} shares no key with the model, so strict=False would load nothing: the model has "
            f"{_short(list(expected))}, the checkpoint {_short(list(saved))}"
            + _prefix_hint(list(expected), list(saved))
        )
    if not strict and (missing or unexpected):
        logger.warning(
            "strict=False: loading %d of the model's %d keys from %s; %d missing from the checkpoint %s, "
            "%d in the checkpoint not in the model %s",
            len(expected) - len(missing),
            len(expected),
            source,
            len(missing),
            _short(missing) if missing else "",
            len(unexpected),
            _short(unexpected) if unexpected else "",
        )
    bad = []
    for key, value in expected.items():
        got = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape != value.shape:
            bad.append(f"{key}: saved {tuple(got.shape)}, model {tuple(value.shape)}")
    if bad:
        raise StateMismatchError(f"{source} has shapes that do not match the model: {_short(bad)}")


def load_optimizer_state(optimizer: Any, state: Any, *, source: str, device: torch.device | None = None) -> None:
    """Load ``state`` into ``optimizer`` (the one inside any framework wrappers); the optimizer itself moves state to
    its parameters' devices."""
    if isinstance(optimizer, dict):
        _fill_dict(optimizer, state, "optimizer", device)
        return
    optimizer = optimizers.unwrap_optimizer(optimizer)
    params = _optimizer_params(optimizer)
    _check_target_device(optimizer, params, device, "optimizer")
    check_optimizer_state(optimizer, state, source=source)
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise StateMismatchError(f"loading {source} into the optimizer failed: {e}") from e
    if xla.loaded() is not None:
        xla.sync_tree(optimizer.state_dict())


PARAM_SHAPED_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "ax", "prev",
     "exp_inf", "grad_avg", "mu"}
)  # fmt: skip
"""Per-parameter state of torch's optimizers that has exactly the parameter's shape (Adafactor-style factored
statistics do not, so they are not checked)."""


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    groups = getattr(optimizers.unwrap_optimizer(optimizer), "param_groups", None) or []
    return [p for g in groups for p in g.get("params", []) if isinstance(p, torch.Tensor)]


def check_optimizer_state(optimizer: Any, state: Any, *, source: str) -> None:
    """Raise StateMismatchError when saved per-parameter state (``exp_avg``...) does not have the shape of the
    parameter it will be attached to, instead of loading it and failing later inside ``optimizer.step()``.

    torch pairs saved state with parameters by position in ``param_groups``; ZeRO-1 optimizers keep theirs in
    ``base_state`` for their shards (checked against the shards, which have the same shapes after the load)."""
    opt = optimizers.unwrap_optimizer(optimizer)
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        return
    if "base_state" in state and hasattr(opt, "base_optimizer"):
        per_param, groups = state["base_state"], getattr(opt.base_optimizer, "param_groups", [])
    else:
        per_param, groups = state.get("state"), getattr(opt, "param_groups", [])
    if not isinstance(per_param, dict) or len(groups) != len(state["param_groups"]):
        return  # the optimizer's own load_state_dict reports group mismatches
    by_id: dict[Any, torch.Tensor] = {}
    for saved_group, group in zip(state["param_groups"], groups, strict=True):
        by_id.update(zip(saved_group.get("params", []), group.get("params", []), strict=False))
    bad = []
    for pid, entry in per_param.items():
        param = by_id.get(pid)
        if param is None or not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if key in PARAM_SHAPED_STATE and isinstance(value, torch.Tensor) and value.shape != param.shape:
                bad.append(f"param {pid} {key}: saved {tuple(value.shape)}, parameter {tuple(param.shape)}")
    if bad:
        raise StateMismatchError(
            f"{source} does not fit the optimizer's parameters: {_short(bad)}. Was it saved for another model, "
            "another parameter order, or another ZeRO-1/TP layout?"
        )


def load_scheduler_state(scheduler: Any, state: Any, *, source: str, device: torch.device | None = None) -> None:
    if isinstance(scheduler, dict):
        _fill_dict(scheduler, state, "scheduler", device)
        return
    scheduler.load_state_dict(state)


def _prefix_hint(model_keys: list[str], saved_keys: list[str]) -> str:
    """'; ...' suggesting the prefix that would make the keys match (e.g. a DDP 'module.'), or ''."""
    for have, want, verb in ((saved_keys, model_keys, "strip"), (model_keys, saved_keys, "add")):
        first = have[0]
        head, dot, _ = first.partition(".")
        if dot and f"{first[len(head) + 1 :]}" in want:
            return (
                f"; the checkpoint's keys look {'prefixed' if verb == 'strip' else 'unprefixed'}: {verb} {head + '.'!r}"
            )
    return ""


def _short(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(i) if "'" not in i and ":" not in i else i for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"
