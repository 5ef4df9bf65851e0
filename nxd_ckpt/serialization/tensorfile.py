"""Write one tensor as a ``torch.save`` file, streaming its bytes with the CRC-32 computed off the GIL.

``torch.save`` computes the zip CRC-32 of the data inside its C++ writer while holding the GIL, and hands the
bytes to a Python stream in one call: with several I/O threads per rank the CRC (about 4 GB/s) and the copy
into the write buffer serialize on the GIL. This writer lays out the same zip archive as PyTorch's
``PyTorchStreamWriter`` (stored records, a data descriptor after each record, 64-byte aligned data, zip64 end
records), record for record and byte for byte, except for ``.data/serialization_id``, which torch derives from
``std::hash`` (ours is derived from the records' CRCs). The pickled part comes from torch's own ``_save``, so
the file says exactly what ``torch.save`` would say about the tensor. The data is streamed in chunks, each
checksummed with zlib-ng's SIMD CRC-32 (zlib's when zlib-ng is missing), which releases the GIL. By default
the padding before a large tensor's data is chosen so that an O_DIRECT stream can write the data from the
tensor's own memory (``save_tensor``); the file then differs from ``torch.save``'s in that padding too.

Anything this writer does not cover falls back to ``torch.save``: archives of 4 GiB or more (zip64 sizes),
a torch whose private ``_save`` changed, a data record that is not the tensor's own storage.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import zipfile
from typing import IO, Any

import numpy as np
import torch

try:  # SIMD CRC-32 (about 25 GB/s here against zlib's 4 GB/s); both release the GIL on large buffers
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; this keeps a broken install working
    from zlib import crc32 as _crc32

ARCHIVE_NAME = "archive"
"""Record prefix ``torch.save`` uses for streams (files it opens by name use their stem instead)."""
ALIGNMENT = 64
"""torch's default ``storage_alignment``: record data starts at a multiple of this offset."""
CHUNK_BYTES = 32 << 20
"""Tensor bytes checksummed and handed to the stream per call."""
PAGE_BYTES = 4096
LINE_UP_MIN_BYTES = 1 << 20
"""Tensors at least this large get their data lined up with their memory address (see ``save_tensor``)."""
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 20)  # above this (minus headroom for the other records) zip64 fields are needed

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_UTF8_NAMES = 0x0800
_HAS_DESCRIPTOR = 0x0008


def _flags(size: int) -> int:
    """miniz's general-purpose flags: UTF-8 names, and a data descriptor after every non-empty record."""
    return _UTF8_NAMES | (_HAS_DESCRIPTOR if size else 0)


def crc32(data: Any, value: int = 0) -> int:
    """The zip CRC-32 of ``data`` (any contiguous buffer) continuing from ``value``; releases the GIL."""
    return _crc32(data, value)


def save_tensor(tensor: torch.Tensor, f: IO[bytes], *, line_up_with_memory: bool = True) -> None:
    """Write ``tensor`` (compact, on the CPU) as ``torch.save(tensor, f)`` would, streaming its bytes.

    With ``line_up_with_memory`` the padding before a large tensor's data is chosen so that the data's file
    offset is congruent to its memory address modulo the page size (and still a multiple of ``ALIGNMENT``):
    an O_DIRECT stream (``storage/direct.py``) can then send it to the disk from the tensor's own memory.
    The file differs from ``torch.save``'s only in that padding; without it, only in the serialization id.
    """
    records = _records(tensor)
    if records is None:
        torch.save(tensor, f)
        return
    writer = _ZipWriter(f, line_up_with_memory)
    for name, data in records:
        writer.add(name, data)
    writer.add("version", _torch_constants()["version"])
    writer.add(".data/serialization_id", writer.serialization_id().encode())
    writer.finish()


def _records(tensor: torch.Tensor) -> list[tuple[str, bytes | np.ndarray]] | None:
    """The records ``torch.save`` writes before its end-of-file records, from torch's own ``_save``; None
    when this writer cannot reproduce them (the caller then uses ``torch.save``)."""
    nbytes = tensor.untyped_storage().nbytes()
    if tensor.device.type != "cpu" or nbytes >= _ZIP32_LIMIT:
        return None
    recorder = _Recorder()
    try:
        torch.serialization._save(tensor, recorder, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    except (TypeError, AttributeError):  # a torch whose private _save differs: let torch.save do it
        return None
    if recorder.unsupported or [n for n, _ in recorder.records if n.startswith("data/")] != ["data/0"]:
        return None
    out: list[tuple[str, bytes | np.ndarray]] = []
    for name, data in recorder.records:
        if isinstance(data, torch.UntypedStorage):
            if data.data_ptr() != tensor.untyped_storage().data_ptr() or data.nbytes() != nbytes:
                return None
            out.append((name, _bytes_view(tensor)))
        else:
            out.append((name, data))
    return out


class _Recorder:
    """Stands in for ``torch._C.PyTorchFileWriter`` during ``torch.serialization._save``: keeps the records."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | torch.UntypedStorage]] = []
        self.unsupported = False

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, (bytes, torch.UntypedStorage)):
            data = bytes(memoryview(data)[:nbytes])
        self.records.append((name, data))

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # torch's skip_data mode
        self.unsupported = True


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array sharing its memory (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


@functools.cache
def _torch_constants() -> dict[str, bytes]:
    """Records torch's writer adds at the end of every file (read once from a tiny ``torch.save``)."""
    buf = io.BytesIO()
    torch.save(torch.empty(0), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        prefix = z.namelist()[0].split("/", 1)[0]
        return {"version": z.read(f"{prefix}/version")}


class _ZipWriter:
    """Stored zip records in miniz's layout for torch: local header padded with an ``FB`` extra field so data
    is aligned, data, data descriptor; then the central directory and zip64 + classic end records."""

    def __init__(self, f: IO[bytes], line_up: bool) -> None:
        self._f = f
        self._line_up = line_up
        self._offset = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, local header offset

    def _write(self, data: bytes | np.ndarray) -> None:
        self._f.write(data)
        self._offset += data.nbytes if isinstance(data, np.ndarray) else len(data)

    def add(self, name: str, data: bytes | np.ndarray) -> None:
        full = f"{ARCHIVE_NAME}/{name}".encode()
        header_offset = self._offset
        start = header_offset + _LOCAL.size + len(full) + 4
        padding = -start % ALIGNMENT
        if self._line_up and isinstance(data, np.ndarray) and data.nbytes >= LINE_UP_MIN_BYTES:
            address = data.ctypes.data
            if address % ALIGNMENT == 0:  # still ALIGNMENT-aligned in the file, and now page-congruent too
                padding = (address - start) % PAGE_BYTES
        extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
        crc, size = 0, len(data)
        flags = _flags(size)
        self._write(_LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
        if isinstance(data, bytes):
            crc = crc32(data)
            self._write(data)
        else:
            for begin in range(0, size, CHUNK_BYTES):
                chunk = data[begin : begin + CHUNK_BYTES]
                crc = crc32(chunk, crc)
                self._write(chunk)
        if size:  # miniz writes no descriptor after an empty record
            self._write(_DESCRIPTOR.pack(0x08074B50, crc, size, size))
        self._entries.append((full, crc, size, header_offset))

    def serialization_id(self) -> str:
        """40 digits, as torch writes (torch combines the CRCs and ``std::hash`` of the names; we use the CRCs)."""
        combined = 0
        for _, crc, _, _ in self._entries:
            combined = (combined * 1_000_003 + crc) % (10**20)
        return f"{combined:020d}{sum(crc for _, crc, _, _ in self._entries) % (10**20):020d}"

    def finish(self) -> None:
        cd_offset = self._offset
        central = b"".join(
            _CENTRAL.pack(0x02014B50, 0, 0, _flags(size), 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
            + name
            for name, crc, size, offset in self._entries
        )
        n = len(self._entries)
        end64_offset = cd_offset + len(central)
        self._write(
            central
            + _END64.pack(0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(central), cd_offset)
            + _LOCATOR.pack(0x07064B50, 0, end64_offset, 1)
            + _END.pack(0x06054B50, 0, 0, n, n, len(central), cd_offset, 0)
        )
