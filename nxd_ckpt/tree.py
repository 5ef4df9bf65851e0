"""Walking nested state (dicts, lists, tuples) and mapping the tensors in it, preserving structure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` with every tensor replaced by ``fn(tensor)``; containers are rebuilt, leaves kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = obj.__class__() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = map_tensors(v, fn)
        return out
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(v, fn) for v in obj]
        return obj.__class__(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in depth-first order; paths join keys and indices with '/'."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}/{i}" if prefix else str(i))


def tensor_bytes(obj: Any) -> int:
    """Total bytes of tensor data in ``obj`` (a shared tensor counts each time it appears)."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(obj))
