"""The xser encoding of ``torch_xla.utils.serialization``, without needing torch_xla.

A state becomes three kinds of files (see docs of the NxD layout):
  * the reference file: ``torch.save`` of the state with every tensor replaced by a ``TensorReference(tid)``
    whose pickled class is ``torch_xla.utils.serialization.TensorReference``; tids number distinct tensors in
    depth-first order from 0, and a tensor stored twice keeps one tid;
  * ``tensor_<tid>.pt``: ``torch.save`` of one compact CPU tensor;
  * the info file NxD adds: ``{tid: {"dtype", "shape", "expert_model_parallel"}}``.
This module only converts between objects and byte streams (no storage, no threads, no ranks): statefile.py
puts the files on storage in parallel and spreads them over DP replicas.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import pickle
import sys
import types
from collections.abc import Callable, Sequence
from typing import IO, Any

import numpy as np
import torch

from nxd_ckpt import tree
from nxd_ckpt.errors import FormatError
from nxd_ckpt.serialization import inmemory, plain, tensorfile, torchzip
from nxd_ckpt.tree import EXPERT_ATTR

XSER_MODULE = "torch_xla.utils.serialization"
_REF_NAME = "TensorReference"
_GLOBAL_OPCODE = pickle.GLOBAL + f"{XSER_MODULE}\n{_REF_NAME}\n".encode()


class TensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``: the tensor file a reference names."""

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        # Ordinary pickling (e.g. sending a reference between ranks) must not need torch_xla; reference files
        # are written by _RefPickler, which emits torch_xla's class instead.
        return _reference, (self.tid,)


def _reference(tid: int) -> TensorReference:
    return TensorReference(tid)


# Pickled and allow-listed under torch_xla's name, so files match torch_xla's byte for byte in that respect.
TensorReference.__module__ = XSER_MODULE
torchzip.register_safe_globals([TensorReference])


def reference_class() -> type:
    """torch_xla's own class when the program already imported it, else the stand-in (same pickled name)."""
    module = sys.modules.get(XSER_MODULE)
    real = getattr(module, _REF_NAME, None) if module is not None else None
    return real if isinstance(real, type) else TensorReference


def is_reference(obj: Any) -> bool:
    """Whether ``obj`` is a tensor reference of a reference file: torch_xla's ``TensorReference`` or the stand-in
    (both pickle as ``torch_xla.utils.serialization.TensorReference``), matched by that name and module as NxD
    matches it (``isinstance(v, xser.TensorReference)``), so a class of another module named so is not one."""
    return type(obj).__name__ == _REF_NAME and type(obj).__module__ == XSER_MODULE and hasattr(obj, "tid")


# ----------------------------------------------------------------------------------------------- encode


def encode(
    state: Any, *, inline_below: int = 0, host: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """Split ``state`` into reference data and its distinct tensors, numbered by a depth-first walk.

    Dicts (OrderedDict kept), lists and tuples are rebuilt; other leaves are kept as they are. The same tensor
    object met twice becomes one tid, as in torch_xla. Tensors of fewer than ``inline_below`` bytes stay inside
    the reference data (compacted, through ``host`` when given: it returns a tensor's host copy), as torch_xla
    keeps CPU tensors: a file each would cost more than their bytes. Other tensors are returned as found.
    """
    ref_cls = reference_class()
    inline, files = classify(state, inline_below=inline_below)
    tids = {id(t): tid for tid, t in enumerate(files)}
    inline_ids = {id(t) for t in inline}
    replaced: dict[int, Any] = {}  # one replacement object per distinct tensor, so sharing survives pickling

    def replace(tensor: torch.Tensor) -> Any:
        if id(tensor) not in replaced:
            if id(tensor) in inline_ids:
                replaced[id(tensor)] = compact(host(tensor) if host is not None else tensor)
            else:
                replaced[id(tensor)] = ref_cls(tids[id(tensor)])
        return replaced[id(tensor)]

    return tree.map_leaves(state, replace, plain=True), files


def classify(state: Any, *, inline_below: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The distinct tensors of ``state`` in depth-first order, split into those kept inline (fewer than
    ``inline_below`` bytes) and those that get a file each (their index is their tid)."""
    inline: list[torch.Tensor] = []
    files: list[torch.Tensor] = []
    seen: set[int] = set()
    for _, t in tree.leaves(state):
        if id(t) not in seen:
            seen.add(id(t))
            (inline if tensor_nbytes(t) < inline_below else files).append(t)
    return inline, files


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU tensor owning exactly its bytes (views and strided tensors are copied, as torch_xla does)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def inline_nbytes(ref_data: Any) -> int:
    """Bytes of the distinct tensors kept inside reference data."""
    from nxd_ckpt.tree import iter_tensors

    return sum(tensor_nbytes(t) for t in {id(t): t for _, t in iter_tensors(ref_data)}.values())


def make_info(tensors: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """The ``.info.pt`` content NxD writes: dtype, shape and expert-parallel flag per tid."""
    return {
        tid: {
            "dtype": t.dtype,
            "shape": t.shape,
            "expert_model_parallel": bool(getattr(t, EXPERT_ATTR, False)),
        }
        for tid, t in enumerate(tensors)
    }


class _RefPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Pure-Python pickler that writes the stand-in class under torch_xla's global name."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorReference:  # exactly what torch_xla's own class pickles to
            return copyreg.__newobj__, (TensorReference,), {"tid": obj.tid}
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is TensorReference:
            self.write(_GLOBAL_OPCODE)
            self.memoize(obj)
            return
        super().save_global(obj, name)


_ref_pickle_module = types.ModuleType("nxd_ckpt_xser_pickle")
_ref_pickle_module.Pickler = _RefPickler  # type: ignore[attr-defined]
_ref_pickle_module.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]


def save_ref(ref_data: Any, f: IO[bytes]) -> None:
    """Write the reference file (loadable by ``torch_xla.utils.serialization.load`` and by ``load_ref``)."""
    torch.save(ref_data, f, pickle_module=_ref_pickle_module)


def save_info(info: dict[int, dict[str, Any]], f: IO[bytes]) -> None:
    torch.save(info, f)


def save_tensor(tensor: torch.Tensor, f: IO[bytes]) -> None:
    """Write one ``tensor_<tid>.pt``: the ``torch.save`` file of a compact CPU tensor, streamed into ``f`` in
    chunks with the zip CRC-32 computed off the GIL (see tensorfile.py), so I/O threads do not serialize."""
    tensorfile.save_tensor(compact(tensor), f)


# ----------------------------------------------------------------------------------------------- decode


class _RefUnpickler(pickle.Unpickler):
    """Trusted (full pickle) loading that maps torch_xla's reference class to the stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if module == XSER_MODULE and name == _REF_NAME:
            return TensorReference
        return super().find_class(module, name)


_trusted_pickle_module = types.ModuleType("nxd_ckpt_xser_unpickle")
_trusted_pickle_module.Unpickler = _RefUnpickler  # type: ignore[attr-defined]
_trusted_pickle_module.Pickler = pickle.Pickler  # type: ignore[attr-defined]
_trusted_pickle_module.load = pickle.load  # type: ignore[attr-defined]


def load_ref(f: IO[bytes], *, what: str, trusted: bool = False) -> Any:
    """Read a reference file (ours, torch_xla's or NxD's); references come back as the stand-in class."""
    if not trusted:
        return plain.load(f, what=what)
    try:
        return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_trusted_pickle_module)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise FormatError(f"{what} is truncated or not a torch.save file: {e}") from e


def load_info(f: IO[bytes], *, what: str) -> dict[int, dict[str, Any]]:
    info = plain.load(f, what=what)
    if not isinstance(info, dict):
        raise FormatError(f"{what} is not an xser info file (expected a dict of tid -> dtype/shape)")
    return info


def referenced_tids(ref_data: Any) -> list[int]:
    """Distinct tids named by the references in ``ref_data``, in depth-first order."""
    return list(dict.fromkeys(int(ref.tid) for _, ref in tree.leaves(ref_data, is_reference)))


def decode(ref_data: Any, tensors: dict[int, torch.Tensor], *, what: str) -> Any:
    """Put the loaded tensors back in place of their references (tensors stored inline are kept)."""

    def resolve(ref: Any) -> torch.Tensor:
        try:
            return tensors[int(ref.tid)]
        except KeyError:
            raise FormatError(f"{what} refers to tensor {ref.tid}, which was not loaded") from None

    return tree.map_leaves(ref_data, resolve, is_reference, plain=True)


def info_meta(info: dict[int, dict[str, Any]] | None, tid: int) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """dtype and shape of tensor ``tid`` as its info file records them, or None when it does not (torch_xla's
    files have no info file)."""
    entry = info.get(tid) if info is not None else None
    if isinstance(entry, dict) and isinstance(entry.get("dtype"), torch.dtype) and entry.get("shape") is not None:
        return entry["dtype"], tuple(int(d) for d in entry["shape"])
    return None


def tensor_meta(
    value: Any, info: dict[int, dict[str, Any]] | None, tensor_of: Callable[[int], torch.Tensor]
) -> tuple[torch.dtype, tuple[int, ...]]:
    """dtype and shape of a tensor leaf of a state file without reading its data: a tensor's own (inline, or on
    ``meta``), else the info file's record of the reference's tid, else those of ``tensor_of(tid)`` (the tensor
    file, read by the caller as cheaply as it can: torch_xla's files have no info file)."""
    if not is_reference(value):
        return value.dtype, tuple(value.shape)
    tid = int(value.tid)
    recorded = info_meta(info, tid)
    if recorded is not None:
        return recorded
    tensor = tensor_of(tid)
    return tensor.dtype, tuple(tensor.shape)


def check_against_info(tid: int, tensor: torch.Tensor, info: dict[int, dict[str, Any]] | None, *, what: str) -> None:
    """Raise FormatError when the info file disagrees with a loaded tensor (or does not list its tid)."""
    if info is None:
        return
    entry = info.get(tid)
    if not isinstance(entry, dict):
        raise FormatError(f"{what}: the info file has no entry for tensor {tid}; the checkpoint is inconsistent")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype != tensor.dtype or tuple(shape if shape is not None else ()) != tuple(tensor.shape):
        raise FormatError(
            f"{what} holds a {tensor.dtype} tensor of shape {tuple(tensor.shape)} but the info file says "
            f"{dtype} {tuple(shape) if shape is not None else None}; the checkpoint is inconsistent or damaged"
        )


def load_tensor(f: IO[bytes], *, what: str) -> torch.Tensor:
    """Read one ``tensor_<tid>.pt`` onto the CPU, reading each storage with one large ``readinto``.

    ``torch.load`` of a stream copies data through many small reads; this reads the zip records torch wrote
    straight into freshly allocated tensor memory. Anything unusual falls back to ``torch.load``.
    """
    try:
        result = _load_tensor_direct(f, what)
    except FormatError:
        raise
    except Exception:  # an unexpected layout: let torch.load decide (and report) instead
        f.seek(0)
        result = plain.load(f, what=what)
    if not isinstance(result, torch.Tensor):
        raise FormatError(f"{what} does not hold a tensor (found {type(result).__name__})")
    return result


def load_tensor_buffer(buffer: np.ndarray, *, what: str) -> torch.Tensor:
    """Read one ``tensor_<tid>.pt`` held in memory (``Storage.read_buffer``); the tensor shares ``buffer``.

    No bytes are copied when the data record is aligned (torch.save aligns to 64); anything unusual falls back
    to ``torch.load`` over the buffer.
    """
    try:
        result = inmemory.load_zero_copy(buffer, what)
    except FormatError:
        raise
    except Exception:  # an unexpected layout: let torch.load decide (and report) instead
        result = plain.load(inmemory.BufferReader(buffer), what=what)
    if not isinstance(result, torch.Tensor):
        raise FormatError(f"{what} does not hold a tensor (found {type(result).__name__})")
    return result


def tensor_unpickler(data: io.BytesIO) -> Any:
    """The safe unpickler of a tensor file's ``data.pkl`` (for readers that parse tensor files themselves)."""
    return torchzip.make_unpickler(data.getvalue(), trusted=False)


def _load_tensor_direct(f: IO[bytes], what: str) -> Any:
    """``torchzip``'s reader with each storage read by one ``readinto`` into fresh tensor memory."""
    reader, pickled = torchzip.open_zip(f, what)

    def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            f.seek(reader.get_record_offset(f"data/{key}"))
            _read_exactly(f, buffer, what)
        return buffer.untyped_storage()

    return torchzip.load_records(pickled, source, what=what, trusted=False, word_errors=False)


def _read_exactly(f: IO[bytes], buffer: torch.Tensor, what: str) -> None:
    nbytes = buffer.numel()
    view = memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise FormatError(f"{what} is truncated: expected {nbytes} bytes of tensor data, found {done}")
        done += n


# ----------------------------------------------------------------------------------------------- replicas


def balance(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` split into ``parts`` bins of about equal total: largest first, each onto the
    lightest bin (ties to the lower index and bin), so every replica computes the same split."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(parts), key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += sizes[i]
    return [sorted(b) for b in bins]


def replica_share(tensors: Sequence[torch.Tensor], replicas: Sequence[int], rank: int) -> list[int]:
    """The tids of an xser state file's tensor files that ``rank`` writes, in the order it writes them
    (largest first); the replicas split the files by ``balance``."""
    replicas = tuple(replicas) if replicas else (rank,)
    if rank not in replicas:
        raise ValueError(f"rank {rank} is not one of the replicas {replicas} of this state file")
    sizes = [tensor_nbytes(t) for t in tensors]
    share = balance(sizes, len(replicas))[replicas.index(rank)]
    return sorted(share, key=lambda i: -sizes[i])
