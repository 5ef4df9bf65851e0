"""A Python-only native accelerator for tests without a GPU: ``fakeacc`` tensors keep their bytes in host memory,
kernels run at once on the stream that issues them (the training stream), and copies enqueued ``non_blocking`` on
another stream are deferred until an event recorded after them, or their stream, is waited for.

So a checkpoint path that reads a host buffer before its copy has run, reuses a buffer whose copy is still queued, or
lets training update a tensor that a queued copy has not read yet gets other bytes, as it would on a GPU. What the
fake cannot show is speed, or a kernel and a copy really running at once.

Two devices, ``fakeacc:0`` and ``fakeacc:1``, and a current device per thread as CUDA keeps it: a new thread starts
on 0, ``torch.fakeacc.device(i)`` and ``set_device`` change it, and a stream's context moves to the stream's device
(as ``torch.cuda.stream`` does). Each call that would need a device context on CUDA (a side stream made, a copy
queued on it, an event recorded or waited for, page-locked memory allocated, registered or unregistered) is kept in
``CALLS`` with the calling thread's current device: where CUDA would have opened a context for it.

``install`` registers the backend with PyTorch's hooks for backends written in Python
(``torch.utils.backend_registration``): process-wide and for good, so tests use it in a child process. Page-locked
memory needs C++ hooks such a backend cannot register: ``NativeDevice.pinned_empty`` hands out ordinary host memory
filled with a marker here (0xFF bytes: NaN for floats), so a buffer read before its copy shows it. ``torch.fakeacc``
offers ``host_register`` / ``host_unregister``, through which ``NativeDevice.staging_empty`` locks large staging
buffers in place (as through ``cudaHostRegister``); they mark the range the same way and keep it in ``REGISTERED``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

DEVICE_TYPE = "fakeacc"
DEVICE_COUNT = 2
FREE_BYTES = 16 << 30
"""What ``mem_get_info`` reports free (a test may change it)."""
TOTAL_BYTES: int | None = None
"""What ``mem_get_info`` reports as the device's size (None: twice ``FREE_BYTES``)."""
RESERVED_BYTES = 0
"""What ``memory_reserved`` reports: the caching allocator's memory now."""
PEAK_RESERVED_BYTES = 0
"""What ``max_memory_reserved`` reports: the most the caching allocator held (training's peak)."""
CLONES_BEFORE_OOM: int | None = None
"""Set: the device runs out of memory (``torch.OutOfMemoryError``) at every clone after this many more succeeded
(``out_of_memory_after``)."""

_aten = torch.ops.aten


@dataclass(frozen=True)
class Call:
    """A call that needs a device context on CUDA: what it was, the calling thread's current device then, the
    thread's name, and the stream it concerned (if any)."""

    what: str
    device: int
    thread: str
    stream: Stream | None = None


CALLS: list[Call] = []
"""Every ``Call`` so far, in order (a test clears it before what it checks)."""
REGISTERED: dict[int, int] = {}
"""Host ranges registered now (``host_register``): address -> length."""
_current = threading.local()
"""Per thread: ``device`` (the current device, 0 unless set) and ``streams`` (device -> the current stream)."""


def current_device() -> int:
    """The calling thread's current device (0 in a thread that never set one, as in CUDA)."""
    return getattr(_current, "device", 0)


def set_device(device: Any) -> None:
    _current.device = _index(device)


def _index(device: Any) -> int:
    """The device index that ``device`` (an index, a ``torch.device``, a string or None for the current) names."""
    if device is None:
        return current_device()
    index = device if isinstance(device, int) else torch.device(device).index
    index = current_device() if index is None else index
    if not 0 <= index < DEVICE_COUNT:
        raise ValueError(f"{DEVICE_TYPE} has {DEVICE_COUNT} devices, got index {index}")
    return index


class device:  # torch.cuda.device's name
    """``with torch.fakeacc.device(i):`` the block runs with ``i`` as the thread's current device."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device)
        self._previous: list[int] = []

    def __enter__(self) -> None:
        self._previous.append(current_device())
        set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        set_device(self._previous.pop())


def _record(what: str, stream: Stream | None = None) -> None:
    CALLS.append(Call(what, current_device(), threading.current_thread().name, stream))  # list.append is atomic


class FakeAccTensor(torch.Tensor):
    """A tensor on ``fakeacc:index``: a wrapper whose ``inner`` CPU tensor holds the bytes."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int = 0, requires_grad: bool = False) -> FakeAccTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            inner.shape,
            dtype=inner.dtype,
            device=torch.device(DEVICE_TYPE, index),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            requires_grad=requires_grad,
        )

    def __init__(self, inner: torch.Tensor, index: int = 0, requires_grad: bool = False) -> None:
        self.inner = inner
        _LIVE.add(self)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeAccTensor({self.inner!r}, device={self.device})"

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.inner.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.clone.default:
            _allocate_clone()
        if func is _aten.copy_.default:
            return _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking")))
        if func is _aten._to_copy.default and _is_host(kwargs.get("device")):
            return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        index = _result_index(args, kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        by_inner = {id(a.inner): a for a in args if isinstance(a, FakeAccTensor)}
        return tree_map(lambda x: _rewrap(x, by_inner, index), out)


def _allocate_clone() -> None:
    """A clone's device memory: refused once ``CLONES_BEFORE_OOM`` more clones have been made."""
    global CLONES_BEFORE_OOM
    if CLONES_BEFORE_OOM is None:
        return
    if CLONES_BEFORE_OOM <= 0:
        raise torch.OutOfMemoryError(f"{DEVICE_TYPE}: out of memory (injected: the device has no room for a clone)")
    CLONES_BEFORE_OOM -= 1


@contextlib.contextmanager
def out_of_memory_after(clones: int) -> Iterator[None]:
    """Inside the block the device has room for ``clones`` more clones; every later one raises
    ``torch.OutOfMemoryError``, as a full device does."""
    global CLONES_BEFORE_OOM
    CLONES_BEFORE_OOM = clones
    try:
        yield
    finally:
        CLONES_BEFORE_OOM = None


_LIVE: weakref.WeakSet[FakeAccTensor] = weakref.WeakSet()
"""Every ``fakeacc`` tensor alive (``live_bytes``)."""


def live_bytes() -> int:
    """The fake's device memory in use: bytes of the storages of the ``fakeacc`` tensors alive now (views once)."""
    storages = {}
    for t in list(_LIVE):
        storage = t.inner.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _is_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _result_index(args: tuple, kwargs: dict) -> int:
    """The device of an op's new tensors: the one it names (``device=``), else its first device input's."""
    named = kwargs.get("device")
    if named is not None and torch.device(named).type == DEVICE_TYPE:
        return _index(named)
    first = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, FakeAccTensor)), None)
    return first.device.index if first is not None else current_device()


def _unwrap(x: Any) -> Any:
    if isinstance(x, FakeAccTensor):
        return x.inner
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("cpu")
    return x


def _rewrap(x: Any, by_inner: dict[int, FakeAccTensor], index: int) -> Any:
    """An op's result on the device: an input given back (in-place ops) as that input, a new tensor wrapped."""
    if not isinstance(x, torch.Tensor) or isinstance(x, FakeAccTensor):
        return x
    given = by_inner.get(id(x))
    return given if given is not None else FakeAccTensor(x, index)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """``dst.copy_(src)``: now on a default stream; on another, queued when ``non_blocking``, else run after what
    that stream holds (a blocking copy keeps its stream's order and returns once done)."""
    dst_inner, src_inner = _unwrap(dst), _unwrap(src)
    stream = current_stream()
    if stream.is_default:
        dst_inner.copy_(src_inner)
    elif non_blocking:
        _record("copy", stream)
        stream.enqueue(lambda: dst_inner.copy_(src_inner))
    else:
        stream.synchronize()
        dst_inner.copy_(src_inner)
    return dst


def _empty_strided(size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:  # fmt: skip
    return FakeAccTensor(torch.empty_strided(size, stride, dtype=dtype), _index(device))


def _empty(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> torch.Tensor:  # fmt: skip
    return FakeAccTensor(torch.empty(size, dtype=dtype), _index(device))


class Stream:
    """A queue of deferred copies on one device (``device``, else the current one); a default stream runs
    everything at once. ``waited``: the events ``wait_event`` was given."""

    def __init__(self, device: Any = None, priority: int = 0, *, default: bool = False) -> None:
        self.is_default = default
        self.index = _index(device)
        self.waited: list[Event] = []
        self._lock = threading.Lock()
        self._queue: list[Callable[[], None]] = []
        self._enqueued = 0
        self._ran = 0

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, self.index)

    def enqueue(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(work)
            self._enqueued += 1

    @property
    def position(self) -> int:
        return self._enqueued

    def run_until(self, position: int) -> None:
        """Run the queued work up to ``position`` (what an event recorded then waits for)."""
        with self._lock:
            while self._ran < position:
                self._queue.pop(0)()
                self._ran += 1

    def synchronize(self) -> None:
        self.run_until(self._enqueued)

    def query(self) -> bool:
        return self._ran >= self._enqueued

    def wait_event(self, event: Event) -> None:
        _record("stream wait", self)
        self.waited.append(event)
        event.complete()  # this stream's later work runs at once: it must see the event's work done

    def wait_stream(self, stream: Stream) -> None:
        stream.synchronize()

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event


class Event:
    """Marks a stream's queue: done once the work queued before ``record`` has run."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._stream: Stream | None = None
        self._position = 0

    def record(self, stream: Stream | None = None) -> None:
        self._stream = stream if stream is not None else current_stream()
        _record("event record", self._stream)
        self._position = self._stream.position

    def synchronize(self) -> None:
        _record("event synchronize", self._stream)
        self.complete()

    def complete(self) -> None:
        """Run the work the event waits for (no call of the backend's: the fake's own bookkeeping)."""
        if self._stream is not None:
            self._stream.run_until(self._position)

    def query(self) -> bool:
        return self._stream is None or self._stream._ran >= self._position

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)


_DEFAULT_STREAMS = [Stream(i, default=True) for i in range(DEVICE_COUNT)]
_STREAMS: list[Stream] = []
"""Every side stream made (``synchronize`` runs what they hold)."""


def _thread_streams() -> dict[int, Stream]:
    """The calling thread's current stream of each device that has one set (``stream``)."""
    streams = getattr(_current, "streams", None)
    if streams is None:
        streams = _current.streams = {}
    return streams


def current_stream(device: Any = None) -> Stream:
    index = _index(device)
    return _thread_streams().get(index, _DEFAULT_STREAMS[index])


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAMS[_index(device)]


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """The block's work goes to ``s``, with ``s``'s device current (``torch.cuda.stream`` changes it too)."""
    if s is None:
        yield
        return
    streams = _thread_streams()
    previous = streams.get(s.index)
    streams[s.index] = s
    try:
        with device(s.index):
            yield
    finally:
        if previous is None:
            streams.pop(s.index, None)
        else:
            streams[s.index] = previous


def synchronize(device: Any = None) -> None:
    """Nothing is left queued anywhere (the streams of every thread)."""
    for s in list(_STREAMS):
        s.synchronize()


def host_register(address: int, length: int) -> bool:
    """Lock the host range in place (recorded; the range is marked with 0xFF bytes, as ``pinned_empty``'s are)."""
    _record("host register")
    if any(address < start + size and start < address + length for start, size in REGISTERED.items()):
        raise RuntimeError(f"host range {address:#x}+{length} overlaps a registered one (cudaHostRegister refuses)")
    ctypes.memset(address, 0xFF, length)
    REGISTERED[address] = length
    return True


def host_unregister(address: int) -> None:
    _record("host unregister")
    if REGISTERED.pop(address, None) is None:
        raise RuntimeError(f"host range {address:#x} is not registered (unregistered twice, or never registered)")


class _Module(types.ModuleType):
    """``torch.fakeacc``: the surface ``nxd_ckpt.device.backend.NativeDevice`` and PyTorch's device hooks use."""

    def __init__(self) -> None:
        super().__init__(f"torch.{DEVICE_TYPE}")
        self.Event = Event
        self.current_stream = current_stream
        self.default_stream = default_stream
        self.stream = stream
        self.synchronize = synchronize
        self.device = device
        self.current_device = current_device
        self.set_device = set_device
        self.host_register = host_register
        self.host_unregister = host_unregister

    @staticmethod
    def Stream(device: Any = None, priority: int = 0) -> Stream:
        s = Stream(device, priority)
        _record("stream", s)
        _STREAMS.append(s)
        return s

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return DEVICE_COUNT

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return FREE_BYTES, TOTAL_BYTES if TOTAL_BYTES is not None else 2 * FREE_BYTES

    def memory_reserved(self, device: Any = None) -> int:
        return RESERVED_BYTES

    def max_memory_reserved(self, device: Any = None) -> int:
        return PEAK_RESERVED_BYTES

    def memory_allocated(self, device: Any = None) -> int:
        return 0


_installed = False
_library: Any = None


def install() -> None:
    """Register ``fakeacc`` in this process (once; it cannot be undone), and make ``NativeDevice``'s page-locked
    allocations hand out marked host memory (see the module's docstring)."""
    global _installed, _library
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from nxd_ckpt.device import backend

    _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_Module())
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("empty_strided", _empty_strided, "PrivateUse1")
    _library.impl("empty.memory_format", _empty, "PrivateUse1")

    def page_locked_empty(self: Any, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        _record("pinned alloc")
        buffer = torch.empty(tuple(shape), dtype=dtype)
        buffer.view(torch.uint8).fill_(0xFF) if buffer.numel() else None
        return buffer

    backend.NativeDevice._page_locked_empty = page_locked_empty  # type: ignore[method-assign]
    _installed = True
