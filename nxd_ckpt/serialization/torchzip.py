"""The one reader of ``torch.save`` zip archives: how a storage reference in ``data.pkl`` becomes a storage, the
safe-loading allow-list, the thread-safe way it is switched on, and how failures are worded.

Every reader of the format asks this module: ``plain`` (``torch.load`` and whole-file buffers), ``inmemory``
(zero-copy views of a buffer), ``structure`` (meta storages, nothing read), ``xser`` (one tensor file straight
into tensor memory) and ``zero1_io`` (file mappings). They differ only in where a storage's bytes come from,
the ``StorageSource`` they pass to ``load_records``.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch._weights_only_unpickler as _weights_only

from nxd_ckpt.errors import FormatError, UnsafeCheckpointError

StorageSource = Callable[[str, torch.dtype, int], torch.UntypedStorage]
"""(record key, dtype, bytes) -> the untyped storage holding that record's data."""

_extra_safe_globals: list[Any] = []
_switch_lock = threading.Lock()
_users = 0
_saved_globals: list[Any] = []


# ----------------------------------------------------------------------------------------------- allow-list
def register_safe_globals(objs: Iterable[Any]) -> None:
    """Allow more classes in safe loading (format classes such as xser's TensorReference)."""
    for obj in objs:
        if obj not in _extra_safe_globals:
            _extra_safe_globals.append(obj)


def allow_list() -> list[Any]:
    """The classes safe loading accepts beyond torch's own weights-only set."""
    return list(_extra_safe_globals)


def allowed_global_names() -> set[str]:
    """Names (``module.qualname``) of every class and function safe loading accepts."""
    names: set[str] = set()
    with contextlib.suppress(AttributeError):  # private torch API; only used for informational notes
        names |= set(_weights_only._get_allowed_globals())
    for obj in [*torch.serialization.get_safe_globals(), *_extra_safe_globals]:
        obj = obj[0] if isinstance(obj, tuple) else obj
        names.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', obj))}")
    return names


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """The allow-list switched on for weights-only unpickling, safely from many threads at once.

    ``torch.serialization.safe_globals`` edits one process-wide list and restores it on exit, so two threads
    inside it at once could leave one without the allow-list. Here the first thread in adds it and the last
    one out restores torch's list; threads in between share it.
    """
    global _users, _saved_globals
    with _switch_lock:
        if _users == 0:
            _saved_globals = list(torch.serialization.get_safe_globals())
            torch.serialization.add_safe_globals(list(_extra_safe_globals))
        _users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _users -= 1
            if _users == 0:
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(_saved_globals)


# ----------------------------------------------------------------------------------------------- errors
def unsafe_message(what: str, name: str) -> str:
    return (
        f"{what} holds a pickled {name}, which is not on the safe-loading allow-list; loading it would run code "
        "from the checkpoint. If you trust this checkpoint, pass allow_pickle=True (nxd-ckpt: --allow-pickle, "
        "convert-zero1: --allow_pickle)."
    )


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@contextlib.contextmanager
def load_errors(what: str, trusted: bool, name_unsafe: Callable[[str], str] | None = None) -> Iterator[None]:
    """Unpickling errors as FormatError (damaged) or UnsafeCheckpointError (refused), naming ``what``.

    ``name_unsafe(message)`` may name the refused classes better than torch's message does.
    """
    try:
        yield
    except pickle.UnpicklingError as e:
        if trusted or ("weights_only" not in str(e) and "Unsupported global" not in str(e)):
            raise FormatError(f"{what} is not a readable torch.save file: {first_line(e)}") from e
        name = name_unsafe(str(e)) if name_unsafe is not None else None
        if not name:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            name = found.group(1) if found else "object that is not a tensor or plain Python value"
        raise UnsafeCheckpointError(unsafe_message(what, name)) from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{what} is truncated or not a torch.save file: {first_line(e)}") from e


# ----------------------------------------------------------------------------------------------- reading
def open_zip(f: Any, what: str) -> tuple[Any, bytes]:
    """(torch's zip reader, the ``data.pkl`` bytes) of a torch.save file; FormatError if it is not one."""
    try:
        reader = torch._C.PyTorchFileReader(f)
        return reader, reader.get_record("data.pkl")
    except RuntimeError as e:
        raise FormatError(f"{what} is truncated or not a torch.save file: {first_line(e)}") from e


def storage_reference(saved_id: Any) -> tuple[str, torch.dtype, int]:
    """(record key, dtype, bytes) of one persistent id of ``data.pkl``."""
    typename, storage_type, key, _location, numel = saved_id
    if typename not in ("storage", b"storage"):
        raise NotImplementedError(f"persistent id {typename!r}")
    if storage_type is torch.UntypedStorage:
        dtype = torch.uint8
    else:  # _dtype: a legacy storage class's dtype without its deprecation warning
        dtype = getattr(storage_type, "_dtype", None) or storage_type.dtype
    key = key.decode() if isinstance(key, bytes) else str(key)
    return key, dtype, int(numel) * torch._utils._element_size(dtype)


def make_unpickler(pickled: bytes, trusted: bool) -> Any:
    """torch's weights-only unpickler (allow-listed classes only), or the full one for trusted files."""
    if trusted:
        return pickle.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    return _weights_only.Unpickler(io.BytesIO(pickled), encoding="utf-8")


def load_records(
    pickled: bytes,
    source: StorageSource,
    *,
    what: str,
    trusted: bool,
    word_errors: bool = True,
    unpickler: Any = None,
) -> Any:
    """Unpickle ``data.pkl`` with each storage taken from ``source`` (once per record), under the allow-list
    unless ``trusted``. With ``word_errors`` False, unpickling errors propagate as they are (for readers that
    fall back to ``torch.load``, which words them)."""
    loaded: dict[str, Any] = {}

    def persistent_load(saved_id: Any) -> Any:
        key, dtype, nbytes = storage_reference(saved_id)
        if key not in loaded:
            untyped = source(key, dtype, nbytes)
            loaded[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return loaded[key]

    u = unpickler if unpickler is not None else make_unpickler(pickled, trusted)
    u.persistent_load = persistent_load
    errors = load_errors(what, trusted) if word_errors else contextlib.nullcontext()
    switch = contextlib.nullcontext() if trusted else safe_globals()
    with errors, switch:
        return u.load()


def torch_load(f: Any, what: str, trusted: bool, *, name_unsafe: Callable[[str], str] | None = None, **kw: Any) -> Any:
    """``torch.load`` under the same rules (allow-list unless ``trusted``) and error wording."""
    with load_errors(what, trusted, name_unsafe):
        if trusted:
            return torch.load(f, weights_only=False, **kw)
        with safe_globals():
            return torch.load(f, weights_only=True, **kw)
