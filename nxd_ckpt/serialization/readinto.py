"""Reading a ``torch.save`` file front to back, with tensor data landing straight in tensors that already exist.

A resume loads into a model whose parameters are already allocated (and already touched). Reading each file
into a fresh buffer and then copying it into the parameters (``load_state_dict``) costs a first touch of fresh
memory, a second pass over every byte and a whole copy of the state in host memory. ``load_into`` instead reads
the file in one sequential pass: the zip records before the data (``data.pkl``, small ones) into a small
buffer, then asks ``choose`` which existing tensor each saved tensor should land in, and reads each data record
directly into that tensor's memory (``readinto`` of the destination's bytes: with an O_DIRECT stream from
``Storage.open_sequential`` the disk writes there by DMA). Records without a destination get fresh memory. The
pickle is then unpickled a second time over the real storages, so the result is exactly what ``torch.load``
would build (sharing, views, parameters), with destination tensors' memory in place of fresh memory: callers
that then ``copy_`` a loaded tensor into its destination (``load_state_dict``) find them aliased and copy
nothing.

The stream is read strictly in order and exactly once (a verifying stream hashes it as it goes). Anything this
reader does not handle before the first data record (an unexpected record layout, compression, zip64 sizes)
makes it finish the read into one buffer and parse that as before (``Fallback`` carries the bytes).
"""

from __future__ import annotations

import io
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import torch

from nxd_ckpt import tree
from nxd_ckpt.errors import FormatError
from nxd_ckpt.pages import Prefaulter
from nxd_ckpt.serialization import torchzip

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESCRIPTOR = struct.Struct("<IIII")
_DESCRIPTOR_SIG = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x0008
_SCAN_BYTES = 4 << 10
"""First read-ahead while searching for the end of a record of unknown size (doubling up to 1 MiB): small, so
that little of the tensor data behind it is read ahead into a buffer instead of into its destination."""
_MAX_SMALL_RECORD = 256 << 20
"""A record of unknown size longer than this (only ``data.pkl`` can be) is not searched for its end."""
PIECE_BYTES = 16 << 20
"""Tensor data is read in pieces of this size (a verifying stream hashes each piece right after reading it)."""


@dataclass(frozen=True)
class Deferred:
    """A destination made only when its record is reached (``make``: a contiguous CPU tensor of ``dtype`` and
    ``shape`` starting its storage), for destinations drawn from a few reused buffers: carving them all when
    ``data.pkl`` is read would wait for buffers that only reading the records before them frees."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


Chooser = Callable[[Any], dict[int, "torch.Tensor | Deferred"]]
"""Given the unpickled structure with ``meta`` tensors, returns {id(meta tensor): destination tensor, or a
``Deferred`` one}."""
Filled = Callable[[torch.Tensor], None]
"""Called with each destination once all of its bytes have been read (e.g. to send it on to a device)."""


class Fallback(Exception):
    """The file's layout is not one this reader streams; ``data`` holds every byte read so far."""

    def __init__(self, reason: str, data: bytes) -> None:
        super().__init__(reason)
        self.data = data


@dataclass
class ReadStats:
    """What one ``load_into`` did: bytes that landed in destination tensors, and bytes in fresh memory."""

    into_destinations: int = 0
    into_fresh: int = 0
    destinations: list[torch.Tensor] = field(default_factory=list)


class _Sequential:
    """Front-to-back reads of a stream, keeping what it read before the first data record (for a fallback)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.pos = 0
        self._pending = bytearray()  # read ahead while searching for the end of a record of unknown size
        self.history: bytearray | None = bytearray()

    def _raw(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            n = self._f.readinto(view[done:])  # type: ignore[attr-defined]
            if not n:
                break
            done += n
        return done

    def take(self, n: int) -> bytes:
        """Exactly ``n`` bytes (fewer only at the end of the stream). Small takes (zip headers) read a block
        ahead, so a file's headers cost one or two system calls, not one each."""
        if len(self._pending) < n <= _SCAN_BYTES:
            buf = bytearray(_SCAN_BYTES)
            got = self._raw(memoryview(buf))
            self._pending += buf[:got]
        out = bytearray()
        if self._pending:
            out += self._pending[:n]
            del self._pending[:n]
        if len(out) < n:
            buf = bytearray(n - len(out))
            got = self._raw(memoryview(buf))
            out += buf[:got]
        self._note(out)
        return bytes(out)

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` (pending bytes first, then straight from the stream); returns the bytes filled."""
        done = 0
        if self._pending:
            done = min(len(view), len(self._pending))
            view[:done] = self._pending[:done]
            del self._pending[:done]
            self._note(view[:done])
        if done < len(view):
            got = self._raw(view[done:])
            self._note(view[done : done + got])
            done += got
        return done

    def take_until_descriptor(self, what: str) -> bytes:
        """The data of a record whose size only its data descriptor says: scan for the descriptor whose size
        field equals its own distance from the record's start."""
        data = bytearray(self._pending)
        self._pending = bytearray()
        searched = 0
        chunk = _SCAN_BYTES
        while True:
            while True:
                i = data.find(_DESCRIPTOR_SIG, searched)
                if i < 0 or i + _DESCRIPTOR.size > len(data):
                    searched = max(0, len(data) - 3) if i < 0 else i
                    break
                _, _, size, usize = _DESCRIPTOR.unpack_from(data, i)
                if size == i and usize == i:
                    self._pending = data[i + _DESCRIPTOR.size :]
                    head = bytes(data[: i + _DESCRIPTOR.size])
                    self._note(head)
                    return head[:i]
                searched = i + 1
            if len(data) > _MAX_SMALL_RECORD:
                self._note(data)
                raise Fallback(f"no data descriptor within {_MAX_SMALL_RECORD} bytes in {what}", b"")
            buf = bytearray(chunk)
            chunk = min(chunk * 2, 1 << 20)
            got = self._raw(memoryview(buf))
            if not got:
                self._note(data)
                raise Fallback(f"{what} ends inside a record", b"")
            data += buf[:got]

    def rest(self) -> bytes:
        """Everything left in the stream."""
        out = bytearray(self._pending)
        self._pending = bytearray()
        while True:
            buf = bytearray(1 << 20)
            got = self._raw(memoryview(buf))
            if not got:
                break
            out += buf[:got]
        self._note(out)
        return bytes(out)

    def _note(self, data: Any) -> None:
        self.pos += len(data)
        if self.history is not None:
            self.history += data

    def stop_history(self) -> None:
        self.history = None


def _record_key(name: str) -> str | None:
    """``data/<key>`` records hold storages; the archive prefix before the first ``/`` varies."""
    parts = name.split("/", 1)
    rest = parts[1] if len(parts) == 2 else name
    return rest[len("data/") :] if rest.startswith("data/") else None


def _fallback(seq: _Sequential, reason: str) -> Fallback:
    history = bytes(seq.history or b"")
    return Fallback(reason, history + seq.rest())


def load_into(
    f: BinaryIO,
    *,
    what: str,
    make_unpickler: Callable[[io.BytesIO], Any],
    choose: Chooser,
    filled: Filled | None = None,
    allocate: Callable[[int], torch.Tensor] | None = None,
    stats: ReadStats | None = None,
) -> Any:
    """Read the ``torch.save`` zip streamed by ``f`` (from its start, to its end, once) and unpickle it, with
    tensor data read straight into the destinations ``choose`` picks. Raises ``Fallback`` (carrying the whole
    file) for layouts it does not stream, FormatError for a damaged file."""
    load = _StreamingLoad(f, what, make_unpickler, choose, filled, allocate, stats)
    try:
        while (record := load.next_record()) is not None:
            key = _record_key(record.name)
            if key is None or load.pickled is None:  # data.pkl and the small records
                load.small_record(record, key)
            else:
                load.data_record(record, key)
    finally:
        load.stop_prefaulting()
    return load.finish()


@dataclass(frozen=True)
class _Record:
    """A zip local header: the record's name, flags and stored size (its data follows in the stream)."""

    name: str
    flags: int
    csize: int


class _StreamingLoad:
    """One streamed load: the records read so far, the pickle, and where each storage's bytes went."""

    def __init__(
        self,
        f: BinaryIO,
        what: str,
        make_unpickler: Callable[[io.BytesIO], Any],
        choose: Chooser,
        filled: Filled | None,
        allocate: Callable[[int], torch.Tensor] | None,
        stats: ReadStats | None,
    ) -> None:
        self.seq = _Sequential(f)
        self.what = what
        self.make_unpickler = make_unpickler
        self.choose = choose
        self.filled = filled
        self.allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8))
        self.stats = stats if stats is not None else ReadStats()
        self.pickled: bytes | None = None
        self.byteorder: str | None = None
        self.storages: dict[str, tuple[torch.dtype, int]] = {}
        self.destinations: dict[str, torch.Tensor | Deferred] = {}
        self.fresh: dict[str, torch.Tensor] = {}
        """Fresh memory for the storages without a destination, allocated once ``data.pkl`` is read."""
        self.prefaulter: Prefaulter | None = None
        self.loaded: dict[str, torch.UntypedStorage] = {}

    def next_record(self) -> _Record | None:
        """The next local header, or None at the central directory."""
        seq, what = self.seq, self.what
        header = seq.take(4)
        if len(header) < 4:
            raise FormatError(f"{what} is truncated: it ends before its zip directory")
        (sig,) = struct.unpack("<I", header)
        if sig == _CENTRAL_SIG:
            return None
        if sig != _LOCAL_SIG:
            if self.pickled is None:
                raise _fallback(seq, "not a zip record")
            raise FormatError(f"{what} is damaged: unexpected bytes at offset {seq.pos - 4}")
        fixed = header + seq.take(_LOCAL.size - 4)
        if len(fixed) < _LOCAL.size:
            raise FormatError(f"{what} is truncated inside a zip header")
        _, _, flags, method, _, _, _, csize, usize, name_len, extra_len = _LOCAL.unpack(fixed)
        name = seq.take(name_len + extra_len)[:name_len].decode("utf-8", "replace")
        if method != 0 or csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
            if self.pickled is None:
                raise _fallback(seq, f"record {name} is compressed or zip64")
            raise FormatError(f"{what} has an unsupported record {name}")
        return _Record(name, flags, csize)

    def small_record(self, record: _Record, key: str | None) -> None:
        """``data.pkl`` (which decides where each storage goes), ``byteorder`` and the other small records."""
        seq, flags, csize = self.seq, record.flags, record.csize
        if flags & _HAS_DESCRIPTOR and csize == 0:
            data = seq.take_until_descriptor(self.what) if self.pickled is not None or key is None else None
        else:
            data = seq.take(csize)
            if flags & _HAS_DESCRIPTOR and csize:
                seq.take(_DESCRIPTOR.size)
        if data is None:
            raise _fallback(seq, "a data record comes before data.pkl")
        if record.name.endswith("data.pkl") and self.pickled is None:
            self.pickled = data
            try:
                meta, self.storages, meta_keys = _meta_unpickle(data, self.what, self.make_unpickler)
            except Fallback as e:
                raise _fallback(seq, str(e)) from e
            self.destinations = _eligible(meta, self.choose(meta), meta_keys)
            self.fresh = {
                key: self.allocate(nbytes)
                for key, (_, nbytes) in self.storages.items()
                if key not in self.destinations and nbytes
            }
            self.prefaulter = Prefaulter(list(self.fresh.values()))
        elif record.name.endswith("byteorder"):
            self.byteorder = data.decode(errors="replace")

    def data_record(self, record: _Record, key: str) -> None:
        """A storage's bytes, read straight into its destination (or into fresh memory)."""
        seq, what, name = self.seq, self.what, record.name
        if self.byteorder is not None and self.byteorder != sys.byteorder:
            raise _fallback(seq, "byte-swapped file")
        if key not in self.storages:
            raise FormatError(f"{what} has a data record {name} that its pickle does not use")
        seq.stop_history()
        _, nbytes = self.storages[key]
        if record.csize and record.csize != nbytes:
            raise FormatError(f"{what}: record {name} holds {record.csize} bytes, its tensor needs {nbytes}")
        dest = self.destinations.get(key)
        if isinstance(dest, Deferred):
            dest = self.destinations[key] = dest.make()
        fresh = self.fresh.get(key)
        target = _bytes_of(dest) if dest is not None else fresh if fresh is not None else self.allocate(nbytes)
        _read_exactly(seq, target, what, name)
        if record.flags & _HAS_DESCRIPTOR and nbytes:
            desc = seq.take(_DESCRIPTOR.size)
            if len(desc) < _DESCRIPTOR.size or desc[:4] != _DESCRIPTOR_SIG or _DESCRIPTOR.unpack(desc)[2] != nbytes:
                raise FormatError(f"{what} is damaged: record {name} is not followed by its data descriptor")
        if dest is not None:
            self.loaded[key] = dest.untyped_storage()
            self.stats.into_destinations += nbytes
            self.stats.destinations.append(dest)
            if self.filled is not None:
                self.filled(dest)
        else:
            self.loaded[key] = target.untyped_storage()
            self.stats.into_fresh += nbytes

    def stop_prefaulting(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()

    def finish(self) -> Any:
        """The rest of the stream (read and hashed, not parsed), then the unpickled object over the storages."""
        self.seq.stop_history()
        self.seq.rest()  # the central directory and end records: read (and hashed) to the end, not parsed
        if self.pickled is None:
            raise FormatError(f"{self.what} has no data.pkl record; it is not a torch.save file")
        missing = [k for k in self.storages if k not in self.loaded and self.storages[k][1]]
        if missing:
            raise FormatError(f"{self.what} is truncated: tensor data record data/{missing[0]} is missing")
        loaded = self.loaded

        def real(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
            found = loaded.get(key)
            return found if found is not None else torch.empty(0, dtype=torch.uint8).untyped_storage()

        return _unpickle(self.pickled, self.make_unpickler, real)


def _meta_unpickle(
    pickled: bytes, what: str, make_unpickler: Callable[[io.BytesIO], Any]
) -> tuple[Any, dict[str, tuple[torch.dtype, int]], dict[int, str]]:
    """First unpickling, over data-less ``meta`` storages: the structure and shapes, {key: (dtype, bytes)} of
    every storage, and {meta storage address: key} (meta storages have no data address to tell them apart)."""
    storages: dict[str, tuple[torch.dtype, int]] = {}
    keys: dict[int, str] = {}
    keep: list[Any] = []

    def meta_storage(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
        storages[key] = (dtype, nbytes)
        untyped = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        keep.append(untyped)
        keys[untyped.untyped_storage()._cdata] = key
        return untyped.untyped_storage()

    try:
        meta = _unpickle(pickled, make_unpickler, meta_storage)
    except Exception as e:  # the fallback's torch.load words the error, as it always has
        raise Fallback(f"{what}: {e}", b"") from e
    return meta, storages, keys


def _unpickle(pickled: bytes, make_unpickler: Callable[[io.BytesIO], Any], source: torchzip.StorageSource) -> Any:
    """Unpickle ``data.pkl`` with each storage record taken from ``source`` (torchzip's one reading of storage
    references and allow-list switch; errors propagate unworded: the fallback's ``torch.load`` words them)."""
    return torchzip.load_records(
        pickled, source, what="", trusted=False, word_errors=False, unpickler=make_unpickler(io.BytesIO(pickled))
    )


def _eligible(
    meta: Any, chosen: dict[int, torch.Tensor | Deferred], meta_keys: dict[int, str]
) -> dict[str, torch.Tensor | Deferred]:
    """{storage key: destination} for saved tensors that own their whole storage and whose destination is a
    contiguous CPU tensor of the same dtype and shape starting its storage (so the rebuilt tensor is an alias
    of the destination). Others get fresh memory and are copied by the caller as before."""
    tensors = [t for _, t in tree.leaves(meta)]
    users: dict[int, int] = {}
    for t in tensors:
        cdata = t.untyped_storage()._cdata
        users[cdata] = users.get(cdata, 0) + 1
    out: dict[str, torch.Tensor | Deferred] = {}
    for t in tensors:
        dest = chosen.get(id(t))
        cdata = t.untyped_storage()._cdata
        if dest is None or users[cdata] != 1 or cdata not in meta_keys:
            continue
        whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if whole and t.is_contiguous() and _fits(dest, t):
            out[meta_keys[cdata]] = dest
    return out


def _fits(dest: torch.Tensor | Deferred, like: torch.Tensor) -> bool:
    if isinstance(dest, Deferred):
        return dest.dtype == like.dtype and dest.shape == tuple(like.shape)
    return (
        isinstance(dest, torch.Tensor)
        and dest.device.type == "cpu"
        and dest.dtype == like.dtype
        and tuple(dest.shape) == tuple(like.shape)
        and dest.is_contiguous()
        and dest.storage_offset() == 0
        and dest.layout == torch.strided
        and not dest.is_quantized
    )


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _read_exactly(seq: _Sequential, target: torch.Tensor, what: str, name: str) -> None:
    nbytes = target.numel()
    if not nbytes:
        return
    view = memoryview(target.numpy()).cast("B")
    done = 0
    while done < nbytes:
        n = seq.readinto(view[done : min(nbytes, done + PIECE_BYTES)])
        if not n:
            raise FormatError(f"{what} is truncated: record {name} ends after {done} of its {nbytes} bytes")
        done += n


def as_array(data: bytes) -> np.ndarray:
    """The bytes a ``Fallback`` carries, as the uint8 array the in-memory parsers take."""
    out = torch.empty(len(data), dtype=torch.uint8).numpy()
    out[:] = np.frombuffer(data, dtype=np.uint8)
    return out
