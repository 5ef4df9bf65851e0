"""Walking nested state (dicts, lists, tuples) and mapping the tensors in it, preserving structure."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

EXPERT_ATTR = "expert_model_parallel"
"""NxD's mark on expert-parallel parameters and tensors (recorded per tensor in xser info files)."""


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


Path = tuple[Any, ...]
"""Where a value sits in nested state: the keys and indices from the root."""


def children(obj: Any) -> Iterable[tuple[Any, Any]] | None:
    """The one container rule: a dict (any subclass) by key, a list or tuple (named tuples too) by index;
    ``torch.Size``, tensors and everything else are leaves (None)."""
    if isinstance(obj, dict):
        return obj.items()
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return enumerate(obj)
    return None


def rebuild(obj: Any, items: Iterable[tuple[Any, Any]], *, plain: bool = False) -> Any:
    """A container like ``obj`` holding ``items`` (pairs as from ``children``).

    By default containers keep their type (dict subclasses, named tuples), as ``torch.save`` would write them.
    ``plain=True`` is the xser reference-file rule: ``OrderedDict`` is kept, other dicts become ``dict`` and
    named tuples ``tuple``, so a reference file names no user class.
    """
    if isinstance(obj, dict):
        if type(obj) is dict or (plain and not isinstance(obj, OrderedDict)):
            return dict(items)
        if plain or type(obj) is OrderedDict:
            return OrderedDict(items)
        out = obj.__class__()
        for k, v in items:
            out[k] = v
        return out
    values = [v for _, v in items]
    if isinstance(obj, list):
        return values
    if hasattr(obj, "_fields") and not plain:
        return obj.__class__(*values)
    return tuple(values)


def leaves(obj: Any, is_leaf: Callable[[Any], bool] = _is_tensor, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, value) of every value ``is_leaf`` selects, depth-first; containers per ``children``."""
    if is_leaf(obj):
        yield prefix, obj
        return
    items = children(obj)
    if items is not None:
        for k, v in items:
            yield from leaves(v, is_leaf, (*prefix, k))


def map_leaves(
    obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] = _is_tensor, *, plain: bool = False
) -> Any:
    """A copy of ``obj`` with every value ``is_leaf`` selects replaced by ``fn(value)``; containers are rebuilt
    (``rebuild``, ``plain`` as there), other leaves kept."""
    if is_leaf(obj):
        return fn(obj)
    items = children(obj)
    if items is None:
        return obj
    return rebuild(obj, [(k, map_leaves(v, fn, is_leaf, plain=plain)) for k, v in items], plain=plain)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` with every tensor replaced by ``fn(tensor)``; containers keep their types, leaves kept."""

    def mapped(tensor: torch.Tensor) -> Any:
        out = fn(tensor)
        if (
            isinstance(out, torch.Tensor)
            and out is not tensor
            and (hasattr(tensor, EXPERT_ATTR) or hasattr(out, EXPERT_ATTR))
        ):  # copies keep NxD's expert-parallel mark (reused buffers are re-marked each time)
            setattr(out, EXPERT_ATTR, bool(getattr(tensor, EXPERT_ATTR, False)))
        return out

    return map_leaves(obj, mapped)


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in depth-first order; paths join keys and indices with '/'."""
    for path, tensor in leaves(obj):
        joined = "/".join(map(str, path))
        yield (f"{prefix}/{joined}" if prefix and joined else prefix or joined), tensor


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
