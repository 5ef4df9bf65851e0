"""A Python-only native accelerator for tests without a GPU: ``fakeacc`` tensors keep their bytes in host memory,
kernels run at once on the stream that issues them (the training stream), and copies enqueued ``non_blocking`` on
another stream are deferred until an event recorded after them, or their stream, is waited for.

So a checkpoint path that reads a host buffer before its copy has run, reuses a buffer whose copy is still queued, or
lets training update a tensor that a queued copy has not read yet gets other bytes, as it would on a GPU. What the
fake cannot show is speed, or a kernel and a copy really running at once.

``install`` registers the backend with PyTorch's hooks for backends written in Python
(``torch.utils.backend_registration``): process-wide and for good, so tests use it in a child process. Page-locked
memory needs C++ hooks such a backend cannot register: ``NativeDevice.pinned_empty`` hands out ordinary host memory
filled with a marker here (0xFF bytes: NaN for floats), so a buffer read before its copy shows it.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

DEVICE_TYPE = "fakeacc"
FREE_BYTES = 16 << 30
"""What ``mem_get_info`` reports free (a test may change it)."""

_aten = torch.ops.aten


class FakeAccTensor(torch.Tensor):
    """A tensor on ``fakeacc``: a wrapper whose ``inner`` CPU tensor holds the bytes."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False) -> FakeAccTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            inner.shape,
            dtype=inner.dtype,
            device=torch.device(DEVICE_TYPE, 0),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            requires_grad=requires_grad,
        )

    def __init__(self, inner: torch.Tensor, requires_grad: bool = False) -> None:
        self.inner = inner

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeAccTensor({self.inner!r})"

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.inner.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            return _copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking")))
        if func is _aten._to_copy.default and _is_host(kwargs.get("device")):
            return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        by_inner = {id(a.inner): a for a in args if isinstance(a, FakeAccTensor)}
        return tree_map(lambda x: _rewrap(x, by_inner), out)


def _is_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _unwrap(x: Any) -> Any:
    if isinstance(x, FakeAccTensor):
        return x.inner
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("cpu")
    return x


def _rewrap(x: Any, by_inner: dict[int, FakeAccTensor]) -> Any:
    """An op's result on the device: an input given back (in-place ops) as that input, a new tensor wrapped."""
    if not isinstance(x, torch.Tensor) or isinstance(x, FakeAccTensor):
        return x
    given = by_inner.get(id(x))
    return given if given is not None else FakeAccTensor(x)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """``dst.copy_(src)``: now on the default stream; on another, queued when ``non_blocking``, else run after what
    that stream holds (a blocking copy keeps its stream's order and returns once done)."""
    dst_inner, src_inner = _unwrap(dst), _unwrap(src)
    stream = current_stream()
    if stream.is_default:
        dst_inner.copy_(src_inner)
    elif non_blocking:
        stream.enqueue(lambda: dst_inner.copy_(src_inner))
    else:
        stream.synchronize()
        dst_inner.copy_(src_inner)
    return dst


def _empty_strided(size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:  # fmt: skip
    return FakeAccTensor(torch.empty_strided(size, stride, dtype=dtype))


def _empty(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> torch.Tensor:  # fmt: skip
    return FakeAccTensor(torch.empty(size, dtype=dtype))


class Stream:
    """A queue of deferred copies; the default stream runs everything at once."""

    def __init__(self, device: Any = None, priority: int = 0, *, default: bool = False) -> None:
        self.is_default = default
        self._lock = threading.Lock()
        self._queue: list[Callable[[], None]] = []
        self._enqueued = 0
        self._ran = 0

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, 0)

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
        event.synchronize()  # this stream's later work runs at once: it must see the event's work done

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
        self._position = self._stream.position

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._position)

    def query(self) -> bool:
        return self._stream is None or self._stream._ran >= self._position

    def wait(self, stream: Stream | None = None) -> None:
        self.synchronize()


_DEFAULT_STREAM = Stream(default=True)
_STREAMS: list[Stream] = []
"""Every side stream made (``synchronize`` runs what they hold)."""
_current = threading.local()


def current_stream(device: Any = None) -> Stream:
    return getattr(_current, "stream", _DEFAULT_STREAM)


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    previous = current_stream()
    _current.stream = s if s is not None else previous
    try:
        yield
    finally:
        _current.stream = previous


def synchronize(device: Any = None) -> None:
    """Nothing is left queued anywhere (the streams of every thread)."""
    for s in list(_STREAMS):
        s.synchronize()


class _Module(types.ModuleType):
    """``torch.fakeacc``: the surface ``nxd_ckpt.device.backend.NativeDevice`` and PyTorch's device hooks use."""

    def __init__(self) -> None:
        super().__init__(f"torch.{DEVICE_TYPE}")
        self.Event = Event
        self.current_stream = current_stream
        self.default_stream = default_stream
        self.stream = stream
        self.synchronize = synchronize

    @staticmethod
    def Stream(device: Any = None, priority: int = 0) -> Stream:
        s = Stream(device, priority)
        _STREAMS.append(s)
        return s

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return FREE_BYTES, 2 * FREE_BYTES

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def memory_allocated(self, device: Any = None) -> int:
        return 0


_installed = False
_library: Any = None


def install() -> None:
    """Register ``fakeacc`` in this process (once; it cannot be undone), and make ``NativeDevice.pinned_empty`` hand
    out marked host memory (see the module's docstring)."""
    global _installed, _library
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from nxd_ckpt.device import backend

    _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_Module())
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("empty_strided", _empty_strided, "PrivateUse1")
    _library.impl("empty.memory_format", _empty, "PrivateUse1")

    def pinned_empty(self: Any, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=dtype)
        buffer.view(torch.uint8).fill_(0xFF) if buffer.numel() else None
        return buffer

    backend.NativeDevice.pinned_empty = pinned_empty  # type: ignore[method-assign]
    _installed = True
