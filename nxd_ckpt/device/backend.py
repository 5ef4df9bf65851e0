"""What a device is to the checkpoint: its kind, a native accelerator's streams, its free memory, the snapshot budget.

Three kinds of tensor reach a save: host tensors (``cpu``), XLA tensors (Trn1/Inf2 through torch_xla: lazy, moved
by bulk transfers in ``nxd_ckpt.xla``) and tensors of a native accelerator backend (CUDA, or any backend with the
``torch.<type>`` module surface that ``torch.accelerator`` builds on: streams, events, pinned host memory, memory
info). ``meta`` tensors carry shapes only and never move.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from nxd_ckpt import knobs, xla
from nxd_ckpt.device.pinned import REGISTER_MIN_BYTES, registered_empty

BUDGET_ENV = "NXD_CKPT_DEVICE_SNAPSHOT_BUDGET"
FREE_FRACTION = 0.9
"""Of the device memory training left unused at its peak, the part a snapshot may take by default (``auto``)."""
SOURCE_SET = "set"
SOURCE_PEAK = "device memory left at the training's peak"
SOURCE_HOST = "half the host's available memory (XLA CPU device)"
SOURCE_NONE = "no peak memory figure from the runtime: no device copy"


def kind(t: torch.Tensor) -> str:
    """``"cpu"``, ``"meta"``, ``"xla"`` or ``"native"`` (any other device type: an accelerator backend)."""
    device_type = t.device.type
    if device_type in ("cpu", "meta", "xla"):
        return device_type
    return "native"


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes live off the host (XLA or a native accelerator)."""
    return kind(t) in ("xla", "native")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> tuple | None:
    """What names the bytes ``t`` shows: where they live (a native or host address, an XLA tensor's data id), its
    shape, strides and dtype. Two tensors with one key hold the same values (aliases over one storage, such as the
    two objects ``state_dict()`` returns for tied weights); None where that is not known (empty, sparse, meta)."""
    if t.numel() == 0 or t.layout != torch.strided or kind(t) == "meta":
        return None
    if kind(t) == "xla":
        data = xla.tensor_id(t)
        if data is None:
            return None
        where: tuple = ("xla", data)
    else:
        where = (str(t.device), t.data_ptr())  # the storage's address plus the tensor's offset in it
    return (*where, tuple(t.shape), tuple(t.stride()), t.dtype)


def distinct_storages(tensors: Sequence[torch.Tensor]) -> tuple[list[int], dict[int, int]]:
    """The indices of ``tensors`` whose bytes are copied (the first of each ``storage_key``, in order), and for
    each other one the index of the tensor it aliases: tied weights are copied and moved once."""
    first: list[int] = []
    alias_of: dict[int, int] = {}
    seen: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        key = storage_key(t)
        if key is not None and key in seen:
            alias_of[i] = seen[key]
            continue
        if key is not None:
            seen[key] = i
        first.append(i)
    return first, alias_of


class NativeDevice:
    """A native accelerator's stream surface (``torch.cuda`` and its siblings): the training thread's stream, a
    side stream for checkpoint copies, events, and page-locked host memory."""

    def __init__(self, device: torch.device) -> None:
        module = getattr(torch, device.type, None)
        if not isinstance(module, ModuleType) or not hasattr(module, "Stream") or not hasattr(module, "Event"):
            raise ValueError(
                f"tensors on {device} cannot be checkpointed asynchronously: torch.{device.type} has no streams and "
                "events; move the state to the host or save with async_save=False"
            )
        self.device = device
        self.module = module

    def current_stream(self) -> Any:
        """The stream the training thread enqueues its work on."""
        return self.module.current_stream(self.device)

    def new_stream(self) -> Any:
        return self.module.Stream(self.device)

    def event(self) -> Any:
        return self.module.Event()

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now: it completes once the work enqueued before it has."""
        event = self.event()
        event.record(stream)
        return event

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Enqueue the block's device work on ``stream``."""
        with self.module.stream(stream):
            yield

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        """Make this device the calling thread's current one for the block (``torch.cuda.device``). A thread starts
        on device 0, and a runtime call made there (registering host memory, waiting for an event) opens a context
        on device 0: on a node of several devices every rank's threads would (pytorch#21081)."""
        select = getattr(self.module, "device", None)
        if self.device.index is None or select is None:
            return contextlib.nullcontext()
        return select(self.device.index)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory from the backend's allocator (copies into and out of it run asynchronously at
        full speed; the allocator keeps a buffer dropped while a copy still runs until that copy is done), allocated
        under this device."""
        with self.guard():
            return self._page_locked_empty(shape, dtype)

    def _page_locked_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def staging_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory for device -> host copies that are always waited for before the buffer can be
        dropped (a save's host copies). Buffers of a MiB or more are pageable memory locked in place where the
        backend can (``pinned.registered_empty``, CUDA's ``cudaHostRegister``: training goes on while they are
        locked; nothing holds them back for a copy still running, hence the rule); others come from
        ``pinned_empty``. Registered under this device, and unregistered under it when dropped."""
        with self.guard():
            hooks = self._host_registration()
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if hooks is not None and nbytes >= REGISTER_MIN_BYTES:
                buffer = registered_empty(shape, dtype, *hooks)
                if buffer is not None:
                    return buffer
            return self.pinned_empty(shape, dtype)

    def _host_registration(self) -> tuple[Callable[[int, int], bool], Callable[[int], None]] | None:
        """(register, unregister) of host ranges for this device (CUDA's ``cudaHostRegister``, or a backend module's
        ``host_register`` / ``host_unregister``), or None where it has none. Unregistration runs in whichever thread
        drops the buffer: under this device."""
        if self.device.type == "cuda":
            if not _cuda_can_register():
                return None
            register: Callable[[int, int], bool] = functools.partial(_cuda_register, device=self.device)
            unregister: Callable[[int], None] = _cuda_unregister
        else:
            register = getattr(self.module, "host_register", None)
            unregister = getattr(self.module, "host_unregister", None)
            if register is None or unregister is None:
                return None

        def guarded_unregister(address: int) -> None:
            with self.guard():
                unregister(address)

        return register, guarded_unregister

    def peak_headroom_bytes(self) -> int | None:
        """Device memory this process's training left unused at its peak: what the driver has free plus what the
        caching allocator holds now, less the most it ever held (``max_memory_reserved``); None where the backend
        reports no peak."""
        module = self.module
        if not all(hasattr(module, f) for f in ("mem_get_info", "memory_reserved", "max_memory_reserved")):
            return None
        try:
            free, _total = module.mem_get_info(self.device)
            reserved, peak = module.memory_reserved(self.device), module.max_memory_reserved(self.device)
        except Exception:
            return None
        return max(0, int(free) + int(reserved) - int(peak))


_CUDA_REGISTER_FAILED: list[str] = []
"""Why ``cudaHostRegister`` failed in this process, once it has: later buffers come from torch's pinned allocator."""


def _cuda_can_register() -> bool:
    return not _CUDA_REGISTER_FAILED and hasattr(torch.cuda, "cudart")


def _cuda_register(address: int, length: int, device: torch.device) -> bool:
    """``cudaHostRegister`` (called under ``device``); False, and later buffers from torch's allocator, if it fails."""
    error = int(torch.cuda.cudart().cudaHostRegister(address, length, 0))
    if error == 0:
        return True
    _CUDA_REGISTER_FAILED.append(f"cudaHostRegister returned error {error}")
    with contextlib.suppress(Exception):  # the runtime keeps the error for this thread's next launch check
        torch.zeros(1, device=device).add_(1)  # a tiny launch on the same device takes it here
    return False


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def native_device(tensors: Sequence[torch.Tensor]) -> NativeDevice | None:
    """The one native device ``tensors`` live on, or None when none is on a native accelerator."""
    devices = {t.device for t in tensors if kind(t) == "native"}
    if len(devices) > 1:
        raise ValueError(f"state spans several accelerator devices {sorted(map(str, devices))}; expected one per rank")
    return NativeDevice(next(iter(devices))) if devices else None


_NO_MEMORY_INFO: set[str] = set()
"""XLA device types whose runtime answered that it keeps no memory statistics: not asked again in this process."""


XLA_PEAK_FIELDS = ("peak_bytes_used", "peak_bytes_in_use")
"""The keys of ``xm.get_memory_info`` that hold the most device memory used so far (runtimes name it differently)."""


def xla_peak_headroom_bytes(device: torch.device) -> int | None:
    """Device memory left unused at the peak so far, as torch_xla reports it (``xm.get_memory_info``: its limit
    less its peak), or None where the runtime reports no peak.

    The CPU client (``PJRT_DEVICE=CPU``) is not asked: it has no allocator statistics, and its refusal took 25 ms
    the first time in a process (inside the first async save's call). A runtime that refuses once is not asked
    again."""
    module = xla.loaded()
    if module is None or _xla_device_is_host_memory():
        return None
    device_type = str(device).split(":")[0]
    if device_type in _NO_MEMORY_INFO:
        return None
    try:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(device)
    except Exception as e:  # runtimes without memory statistics raise
        if "UNIMPLEMENTED" in str(e) or "not supported" in str(e):
            _NO_MEMORY_INFO.add(device_type)
        return None
    peak = next((info[k] for k in XLA_PEAK_FIELDS if k in info), None)
    if "bytes_limit" not in info or peak is None:
        return None
    return max(0, int(info["bytes_limit"]) - int(peak))


def _host_available_bytes() -> int | None:
    """MemAvailable of this host (Linux), or None."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _xla_device_is_host_memory() -> bool:
    """Whether the XLA runtime is the CPU client (PJRT_DEVICE=CPU): its device memory is this host's memory."""
    with contextlib.suppress(Exception):
        import torch_xla.runtime as xr

        return str(xr.device_type()).upper() == "CPU"
    return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"


@dataclass(frozen=True)
class SnapshotBudget:
    """How much device memory an async save may use for its snapshot: ``bytes`` fixed, or None for ``auto``
    (``resolve``: sized from the memory training left unused at its peak)."""

    bytes: int | None

    def resolve(self, tensors: Sequence[torch.Tensor]) -> tuple[int, str]:
        """The budget in bytes for a snapshot of ``tensors``, and where it came from (``SOURCE_*``). ``auto``:
        ``FREE_FRACTION`` of what the training left unused at its peak (native: the caching allocator's peak;
        XLA: the runtime's peak field); the XLA CPU device, whose device memory is host memory, half the host's
        available memory; a runtime without a peak figure, 0 (no device copy: the direct transfer), never a
        single moment's free memory, which the next forward and backward need."""
        if self.bytes is not None:
            return self.bytes, SOURCE_SET
        native = native_device(tensors)
        if native is not None:
            headroom = native.peak_headroom_bytes()
            if headroom is not None:
                return int(headroom * FREE_FRACTION), SOURCE_PEAK
        xla_tensors = [t for t in tensors if kind(t) == "xla"]
        if xla_tensors:
            if _xla_device_is_host_memory():
                available = _host_available_bytes()
                if available is not None:
                    return available // 2, SOURCE_HOST
            headroom = xla_peak_headroom_bytes(xla_tensors[0].device)
            if headroom is not None:
                return int(headroom * FREE_FRACTION), SOURCE_PEAK
        return 0, SOURCE_NONE


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory (torch's ``OutOfMemoryError``, XLA's
    ``RESOURCE_EXHAUSTED``): a snapshot that meets one moves what did not fit by the direct transfer."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def resolve_snapshot_budget(value: int | str | None) -> SnapshotBudget:
    """``device_snapshot_budget=``: bytes or a size (``"8GiB"``; 0 takes no snapshot), ``"auto"``, or None for
    ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET`` (default ``auto``: ``SnapshotBudget.resolve``)."""
    if value is None:
        raw = knobs.device_snapshot_budget()
        if raw.strip().lower() == "auto":
            return SnapshotBudget(None)
        return SnapshotBudget(_parse(raw, BUDGET_ENV))
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return SnapshotBudget(None)
        return SnapshotBudget(_parse(value, "device_snapshot_budget"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"device_snapshot_budget must be None, 'auto', bytes (an integer >= 0) or a size string, got {value!r}"
        )
    return SnapshotBudget(value)


def _parse(raw: str, what: str) -> int:
    if raw.strip() == "0":
        return 0
    parsed = knobs.parse_size(raw)
    if parsed is None:
        raise ValueError(
            f"{what}={raw!r} is not a size; use 'auto', 0 (no device snapshot), bytes, or a size such as '8GiB'"
        )
    return parsed
