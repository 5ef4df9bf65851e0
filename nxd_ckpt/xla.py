"""The torch_xla seam: detection without importing it, one sync for many tensors, bulk device<->host moves.

torch_xla is only imported when the program already did (a state can hold XLA tensors only then) or when a
caller explicitly asks for an XLA device. Device->host moves materialise all pending graphs of the given
tensors with ONE ``_xla_sync_multi`` and then fetch them with ``_xla_get_cpu_tensors`` in batches of at most
``batch_bytes`` (measured 1.3-1.5x faster than per-tensor ``.cpu()``, and the batch bounds the transient host
memory of one transfer). XLA tensors never reach ``torch.distributed``: callers exchange the CPU results.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from nxd_ckpt.errors import DeviceUnavailableError
from nxd_ckpt.tree import iter_tensors, map_tensors

BATCH_BYTES_ENV = "NXD_CKPT_XLA_TRANSFER_BATCH_BYTES"
DEFAULT_BATCH_BYTES = 256 << 20  # 4 x 256 MiB beat 1 x 1 GiB on XLA:CPU (0.86 s vs 1.08 s)


def loaded() -> ModuleType | None:
    """torch_xla if this process already imported it, else None (never imports it)."""
    return sys.modules.get("torch_xla")


def available() -> bool:
    """Whether torch_xla is imported or importable, checked without importing it."""
    return loaded() is not None or importlib.util.find_spec("torch_xla") is not None


def require(reason: str) -> ModuleType:
    """Import torch_xla because ``reason`` explicitly needs it; raise a clear error when it is missing."""
    module = loaded()
    if module is not None:
        return module
    try:
        return importlib.import_module("torch_xla")
    except ImportError as e:
        raise DeviceUnavailableError(
            f"{reason} needs torch_xla, which cannot be imported in this environment ({e}). Install torch-xla "
            "built for exactly this torch version (e.g. torch==2.9.0 with torch-xla==2.9.0), or load onto the CPU "
            "(device=None or 'cpu'); checkpoints of XLA tensors load as CPU tensors without torch_xla."
        ) from e


def resolve_device(device: str | torch.device | None, what: str = "device") -> torch.device | None:
    """Validate a requested device; an XLA device imports torch_xla (clear error if it is missing)."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what}={device!r} is not a valid torch device: {e}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"{what}={str(device)!r} asks for CUDA, but this torch ({torch.__version__}) sees no CUDA device; "
            "load onto 'cpu' (or 'xla' on Trainium) instead"
        )
    if resolved.type == "xla":
        xla = require(f"{what}={str(device)!r}")
        if resolved.index is None:  # this process's default XLA device (torch_xla.device() since 2.5)
            default = getattr(xla, "device", None) or importlib.import_module("torch_xla.core.xla_model").xla_device
            resolved = torch.device(default())
    return resolved


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def tensor_id(t: torch.Tensor) -> int | None:
    """torch_xla's id of the device data behind XLA tensor ``t``, or None where torch_xla has no such call.

    Detached aliases of one tensor (the two objects ``state_dict()`` returns for tied weights) share it in torch_xla
    2.9, under functionalization and with a pending graph alike, while any other tensor (a clone, a slice) gets its
    own: torch_xla hands out each id once. Their storages tell nothing (an XLA tensor's storage has no data
    pointer), and ``_unsafe_buffer_pointer`` fails on a tensor with a pending graph (a save before the step's sync).
    """
    xla = require("telling aliased XLA tensors apart")
    get = getattr(xla._XLAC, "_xla_get_tensor_id", None)
    return int(get(t)) if get is not None else None


def batch_bytes_from_env() -> int:
    """The transfer batch budget in bytes (NXD_CKPT_XLA_TRANSFER_BATCH_BYTES, default 256 MiB)."""
    from nxd_ckpt import knobs

    return knobs.xla_transfer_batch_bytes()


def plan_batches(sizes: Sequence[int], budget: int, first: int | None = None) -> list[list[int]]:
    """Group indices (in order) so each group's total stays within ``budget``; a bigger item goes alone. With
    ``first``, the first group stays within ``first`` and each next one within twice the one before, up to
    ``budget`` (a consumer of the groups starts on a small one while the larger ones travel)."""
    if budget < 1:
        raise ValueError(f"transfer batch budget must be >= 1 byte, got {budget}")
    if first is not None and first < 1:
        raise ValueError(f"first transfer batch must be >= 1 byte, got {first}")
    limit = budget if first is None else min(first, budget)
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        if current and used + size > limit:
            batches.append(current)
            current, used, limit = [], 0, min(2 * limit, budget)
        current.append(i)
        used += size
    if current:
        batches.append(current)
    return batches


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sync(tensors: Sequence[torch.Tensor], *, wait: bool = True) -> None:
    """Materialise the pending graphs of all XLA ``tensors`` with one execution; ``wait`` for it, or only launch it
    (torch_xla then orders later executions and transfers that use the tensors after it)."""
    xla_tensors = [t for t in tensors if is_xla(t)]
    if not xla_tensors:
        return
    xla = require("materialising XLA tensors")
    xla._XLAC._xla_sync_multi(xla_tensors, devices=[], wait=wait, sync_xla_data=False)


def pending(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any XLA tensor of ``tensors`` has a pending graph (its value needs a sync; e.g. right after an
    optimizer step, before the step's ``mark_step``). A torch_xla without the check answers True (not known)."""
    xla_tensors = [t for t in tensors if is_xla(t)]
    if not xla_tensors:
        return False
    xla = require("checking XLA tensors for pending graphs")
    check = getattr(xla._XLAC, "_check_tensor_need_materialization", None)
    return True if check is None else any(check(xla_tensors))


def run_pending_step(tensors: Sequence[torch.Tensor], *, wait: bool = False) -> bool:
    """Run the process's pending graph now when any XLA tensor of ``tensors`` has one (a save called after the
    optimizer step, before the step's sync), and say whether it did.

    It syncs every live tensor of their device, as the user's own ``torch_xla.sync()`` / ``mark_step`` would: the
    same graph (already compiled by the steps before), executed once, after which the user's sync has nothing left
    to run. No step is marked (the device RNG seed and step closures advance at the user's sync, as without the
    save). Syncing only the state's tensors, as NxD's save does, cuts another graph: the step ran 2.4x its own
    device time in ``python -m benchmarks device``'s probe, against 1.03x this way (docs/async.md).

    The device's all-reduce token is reset, as ``torch_xla.sync()`` resets it (torch_xla 2.9: ``sync`` ends with
    ``_set_all_reduce_token(device, None)``): the token of the step's last token-ordered collective (reduce-scatter,
    all-gather: ZeRO-1's) is an IR value of the graph just run, so a collective traced between the save and the
    user's sync would otherwise carry the whole executed step into the next graph (run again, or failing on the
    buffers the step donated)."""
    xla_tensors = [t for t in tensors if is_xla(t)]
    if not xla_tensors or not pending(xla_tensors):
        return False
    xla = require("running the pending step before a save")
    reset_token = getattr(xla._XLAC, "_set_all_reduce_token", None)
    for device in sorted({str(t.device) for t in xla_tensors}):
        xla._XLAC._xla_sync_live_tensors(device, [], wait)
        if reset_token is not None:
            reset_token(device, None)
    return True


def mark_step() -> None:
    """Cut and run this process's pending graph (torch_xla's ``mark_step``); nothing without torch_xla loaded."""
    if loaded() is None:
        return
    importlib.import_module("torch_xla.core.xla_model").mark_step()


def iter_to_cpu(
    tensors: Sequence[torch.Tensor], batch_bytes: int | None = None, *, synced: bool = False
) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """Yield ``(indices, cpu_tensors)`` batch by batch, after one sync for all of ``tensors`` (all XLA).

    Consumers that drop each batch once used keep at most one batch in host memory. The CPU tensors are
    fresh memory: later training steps cannot change them. ``synced`` skips the sync (already done).
    """
    if not tensors:
        return
    if not all(is_xla(t) for t in tensors):
        raise ValueError("iter_to_cpu takes XLA tensors only; move other devices with .to('cpu')")
    xla = require("copying XLA tensors to the host")
    detached = [t.detach() if t.requires_grad else t for t in tensors]  # no new XLA tensors unless needed
    if not synced:
        sync(detached)
    budget = batch_bytes if batch_bytes is not None else batch_bytes_from_env()
    for batch in plan_batches([_nbytes(t) for t in detached], budget):
        yield batch, list(xla._XLAC._xla_get_cpu_tensors([detached[i] for i in batch]))


def fetch(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of materialised XLA ``tensors`` (same order) in one bulk transfer, without a sync: the
    transfer releases the GIL and copies in parallel; the results are fresh host memory."""
    xla = require("copying XLA tensors to the host")
    detached = [t.detach() if t.requires_grad else t for t in tensors]
    return list(xla._XLAC._xla_get_cpu_tensors(detached))


def to_cpu(tensors: Sequence[torch.Tensor], batch_bytes: int | None = None) -> list[torch.Tensor]:
    """CPU copies of XLA ``tensors`` (same order): one sync, then bulk transfers of at most ``batch_bytes``."""
    return _collect(len(tensors), iter_to_cpu(tensors, batch_bytes))


def _collect(n: int, batches: Iterator[tuple[list[int], list[torch.Tensor]]]) -> list[torch.Tensor]:
    """Reassemble per-batch results into one list in the original order."""
    out: list[torch.Tensor | None] = [None] * n
    for batch, results in batches:
        for i, t in zip(batch, results, strict=True):
            out[i] = t
    return out  # type: ignore[return-value]


def to_device(
    tensors: Sequence[torch.Tensor], device: torch.device, batch_bytes: int | None = None
) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` on ``device``; XLA placement uses bulk host->device transfers in batches."""
    if device.type != "xla":
        return [t.to(device) for t in tensors]
    xla = require(f"placing tensors on {device}")
    budget = batch_bytes if batch_bytes is not None else batch_bytes_from_env()
    cpu = [t.detach().to("cpu") for t in tensors]
    batches = plan_batches([_nbytes(t) for t in cpu], budget)
    return _collect(
        len(cpu),
        ((b, xla._XLAC._xla_tensors_from_aten([cpu[i] for i in b], [str(device)] * len(b))) for b in batches),
    )


def place_tree(tree: Any, device: torch.device) -> Any:
    """A copy of ``tree`` with every tensor on ``device`` (shared tensors stay shared); bulk for XLA."""

    unique: dict[int, torch.Tensor] = {}
    for _, t in iter_tensors(tree):
        if t.device != device:
            unique.setdefault(id(t), t)
    if not unique:
        return tree
    keys = list(unique)
    placed = dict(zip(keys, to_device([unique[k] for k in keys], device), strict=True))
    return map_tensors(tree, lambda t: placed.get(id(t), t))


def tree_device(tree: Any) -> torch.device | None:
    """The XLA device every XLA tensor of ``tree`` lives on, or None when it holds no XLA tensor."""
    devices = {t.device for _, t in iter_tensors(tree) if is_xla(t)}
    if len(devices) > 1:
        raise ValueError(f"state spans several XLA devices {sorted(map(str, devices))}; expected one")
    return next(iter(devices), None)


def sync_tree(tree: Any) -> None:
    """One sync for every XLA tensor in ``tree`` (e.g. after loading state into a model on the device)."""
    sync([t for _, t in iter_tensors(tree) if is_xla(t)])
