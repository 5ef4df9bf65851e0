"""Device-to-host staging: turn a state tree into host (CPU) tensors that training cannot change.

XLA tensors are materialised with one sync for the whole tree and moved in bulk transfers; CPU tensors are
copied only when the snapshot must outlive the call (async saves), because ``state_dict()`` returns live
references that the optimizer updates in place.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .tree import iter_tensors, map_tensors


def _torch_xla() -> Any | None:
    """torch_xla if the program already imported it (a state can only hold XLA tensors then)."""
    return sys.modules.get("torch_xla")


def has_device_tensors(tree: Any) -> bool:
    return any(t.device.type != "cpu" for _, t in iter_tensors(tree))


def to_host(tree: Any, *, copy: bool) -> Any:
    """A copy of ``tree`` whose tensors are on the CPU; with ``copy`` CPU tensors are cloned too."""
    device_tensors = {id(t): t for _, t in iter_tensors(tree) if t.device.type != "cpu"}
    host: dict[int, torch.Tensor] = {}
    if device_tensors:
        host = _bulk_to_cpu(list(device_tensors.values()))

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return host[id(t)]
        return t.detach().clone() if copy else t.detach()

    return map_tensors(tree, convert)


def _bulk_to_cpu(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    xla = _torch_xla()
    xla_tensors = [t for t in tensors if t.device.type == "xla"]
    out: dict[int, torch.Tensor] = {}
    if xla_tensors and xla is not None:
        cpu = xla._XLAC._xla_get_cpu_tensors(xla_tensors)
        out.update({id(t): c for t, c in zip(xla_tensors, cpu)})
    for t in tensors:
        if id(t) not in out:
            out[id(t)] = t.detach().to("cpu")
    return out
