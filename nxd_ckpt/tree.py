"""Walking nested state (dicts, lists, tuples) and mapping the tensors in it, preserving structure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

EXPERT_ATTR = "expert_model_parallel"
"""NxD's mark on expert-parallel parameters and tensors (recorded per tensor in xser info files)."""


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` with every tensor replaced by ``fn(tensor)``; containers are rebuilt, leaves kept."""
    if isinstance(obj, torch.Tensor):
        mapped = fn(obj)
        if (
            isinstance(mapped, torch.Tensor)
            and mapped is not obj
            and (hasattr(obj, EXPERT_ATTR) or hasattr(mapped, EXPERT_ATTR))
        ):  # copies keep NxD's expert-parallel mark (reused buffers are re-marked each time)
            setattr(mapped, EXPERT_ATTR, bool(getattr(obj, EXPERT_ATTR, False)))
        return mapped
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


def nxd_containers(obj: Any, _memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with its containers as NxD's save path writes them (torch_xla's structure rewrite): every dict
    (OrderedDict too) becomes a plain dict and every list or tuple (``torch.Size`` and named tuples too) a list.
    Tensors and other leaves are kept, not copied; a container reached twice is rebuilt once.

    NxD's tools compare such values with lists (its ZeRO-1 converter asserts ``list(shape) == shape_info[i]``),
    which a tuple or ``torch.Size`` fails.
    """
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor) or not isinstance(obj, (dict, list, tuple)):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        out: Any = {}
        memo[id(obj)] = out
        for k, v in obj.items():
            out[k] = nxd_containers(v, memo)
        return out
    out = []
    memo[id(obj)] = out
    out.extend(nxd_containers(v, memo) for v in obj)
    return out
