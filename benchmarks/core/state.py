"""CPU state builders (a transformer-like replicated model with ZeRO-1 AdamW shards, flat and named tensors),
the state's tensors and bytes, the equality check of a load, and the live module a resume loads into."""

from __future__ import annotations

from typing import Any

import torch

LAYER_SHAPES = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight", "ln1.weight", "ln2.weight", "fc1.bias",
                "fc2.bias", "proj.bias")  # fmt: skip


def _layer_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """One transformer layer's parameter shapes at ``hidden``."""
    h = hidden
    shapes = {"qkv.weight": (3 * h, h), "proj.weight": (h, h), "fc1.weight": (4 * h, h), "fc2.weight": (h, 4 * h)}
    shapes |= {"ln1.weight": (h,), "ln2.weight": (h,), "fc1.bias": (4 * h,), "fc2.bias": (h,), "proj.bias": (h,)}
    return shapes


def transformer_state(total_bytes: int, rank: int, world: int, hidden: int = 1024) -> tuple[dict, dict]:
    """A replicated fp32 model and this rank's ZeRO-1 shard of AdamW state; model + all shards = total_bytes."""
    shapes = _layer_shapes(hidden)
    per_layer = sum(torch.Size(s).numel() for s in shapes.values()) * 4
    layers = max(1, round(total_bytes / 3 / per_layer))
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.{k}": torch.rand(s, generator=gen) for i in range(layers) for k, s in shapes.items()}
    shard_gen = torch.Generator().manual_seed(1 + rank)
    state = {}
    for i, t in enumerate(model.values()):
        shard = -(-t.numel() // world)
        state[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.rand(shard, generator=shard_gen),
            "exp_avg_sq": torch.rand(shard, generator=shard_gen),
        }
    optimizer = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": list(state)}]}
    return model, optimizer


def flat_state(total_bytes: int, rank: int, world: int, tensors: int = 8) -> tuple[dict, dict]:
    """A replicated fp32 model of ``tensors`` equal flat tensors (a third of the bytes) and this rank's shard of
    AdamW's two moments."""
    n = max(1, total_bytes // 3 // 4 // tensors)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.rand(n, generator=gen) for i in range(tensors)}
    shard = n // world
    state = {
        i: {"step": torch.tensor(5.0), "exp_avg": torch.rand(shard) + rank, "exp_avg_sq": torch.rand(shard)}
        for i in range(tensors)
    }
    return model, {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(tensors))}]}


def named_tensors(total_bytes: int, count: int, name: str = "layers.{i}.weight", seed: int = 0) -> dict:
    """``count`` random fp32 tensors of equal size, ``total_bytes`` in all, named by ``name.format(i=...)``."""
    gen = torch.Generator().manual_seed(seed)
    numel = max(1, total_bytes // 4 // count)
    return {name.format(i=i): torch.randn(numel, generator=gen) for i in range(count)}


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of nested state, in nxd_ckpt's traversal order."""
    from nxd_ckpt.tree import iter_tensors

    return [t for _, t in iter_tensors(tree)]


def nbytes_of(tree: Any) -> int:
    """Bytes of tensor data in nested state (or a list of tensors)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(tree))


def assert_same(a: Any, b: Any, what: str) -> None:
    """Raise unless ``b`` (a loaded state) holds ``a``'s tensors, equal and in the same order."""
    ta, tb = tensors_of(a), tensors_of(b)
    if len(ta) != len(tb) or not all(torch.equal(x, y.cpu()) for x, y in zip(ta, tb, strict=True)):
        raise AssertionError(f"{what}: loaded state differs from the saved one")


def touched_like(tree: Any, value: float = -1.0) -> Any:
    """``tree`` with every tensor replaced by a touched one of its shape (a restore's allocated targets)."""
    from nxd_ckpt.tree import map_tensors

    return map_tensors(tree, lambda t: torch.full_like(t, value))


def live_module(model: dict, device: Any = None) -> torch.nn.Module:
    """An ``nn.Module`` whose state_dict keys are ``model``'s, with its own touched parameter memory (a model
    already built in the resuming process), optionally on ``device``."""
    root = torch.nn.Module()
    for key, value in model.items():
        *owners, leaf = key.split(".")
        module = root
        for name in owners:
            if not hasattr(module, name):
                module.add_module(name, torch.nn.Module())
            module = getattr(module, name)
        module.register_parameter(leaf, torch.nn.Parameter(torch.ones_like(value), requires_grad=False))
    return root.to(device) if device is not None else root


def to_xla(*trees: Any) -> tuple[Any, ...]:
    """``trees`` with every tensor moved to the XLA device, materialised there (as state lives during training)."""
    import torch_xla

    from nxd_ckpt.tree import map_tensors

    dev = torch_xla.device()
    moved = tuple(map_tensors(tree, lambda t: t.to(dev)) for tree in trees)
    torch_xla.sync()
    return moved


def have_torch_xla() -> bool:
    """Whether torch_xla can be imported here."""
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None
