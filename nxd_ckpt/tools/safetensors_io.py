"""The safetensors format, read and written here and nowhere else: single files and Hugging Face-style sets.

A file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape", "data_offsets"}}``
plus an optional ``__metadata__`` of strings), then the tensors' bytes. A set is
``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``), the layout ``transformers`` writes and
reads. Writers stream one tensor at a time (headers are known up front from shapes and dtypes); readers read
one tensor's byte range. No dependency on the ``safetensors`` package: tests read our files with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.storage.local import atomic_file, fsync_path

INDEX_FILE = layout.HF_INDEX_FILE
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default ``max_shard_size`` ("5GB", decimal, in ``save_pretrained``)."""

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit


class SafetensorsError(CheckpointError):
    """A tensor safetensors cannot hold, or a file or set that is not valid safetensors."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a set: its name, dtype and shape (what a header records)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def dtype_code(dtype: torch.dtype, name: str) -> str:
    """safetensors' name of ``dtype``; SafetensorsError naming the tensor when it has none."""
    code = _DTYPES.get(dtype)
    if code is None:
        raise SafetensorsError(f"{name} has dtype {dtype}, which safetensors cannot store")
    return code


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (1-based, as transformers names them)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """Bytes from ``"5GB"`` (decimal, as transformers reads ``max_shard_size``), ``"512MiB"`` or ``"1000"``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 5GB, 500MB or 2GiB, got {text!r}")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return value


def plan_shards(entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Entries grouped into files in order, a new file when the next tensor would pass ``max_shard_bytes``
    (a tensor larger than that gets a file of its own), as ``save_pretrained`` splits."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}")
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    """The JSON header of a file holding ``entries`` in order (padded to 8 bytes)."""
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        doc[e.name] = {
            "dtype": dtype_code(e.dtype, e.name),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    encoded = json.dumps(doc, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)  # 8-byte aligned data, as safetensors' writer does


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (this host is little-endian, as safetensors requires)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def file_size(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> int:
    """The bytes of a file holding ``entries`` (header length, header, data), known before it is written."""
    return 8 + len(_header(entries, metadata)) + sum(e.nbytes for e in entries)


def index_document(files: Sequence[tuple[str, Sequence[TensorEntry]]], metadata: dict[str, str] | None = None) -> dict:
    """A set's index: ``{"metadata": {"total_size": tensor bytes, ...}, "weight_map": {name: file}}``."""
    weight_map = {e.name: name for name, entries in files for e in entries}
    total = sum(e.nbytes for _, entries in files for e in entries)
    return {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}


def index_bytes(document: dict) -> bytes:
    """An index as written (indented JSON, as ``transformers`` and DCP's Hugging Face writer write it)."""
    return (json.dumps(document, indent=2) + "\n").encode()


class FileWriter:
    """One safetensors file streamed into ``f``: its header written first, then each tensor in header order
    (``write``), so one tensor at a time is held."""

    def __init__(self, f: BinaryIO, entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> None:
        self._f, self._pending = f, list(reversed(entries))
        header = _header(entries, metadata)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._pending.pop() if self._pending else None
        if expected is None or expected.name != name:
            raise AssertionError(f"tensor {name!r} written out of order (expected {expected and expected.name!r})")
        if tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
            raise FormatError(
                f"{name} came out as {tensor.dtype} {list(tensor.shape)}, but its source describes it as "
                f"{expected.dtype} {list(expected.shape)}; the source checkpoint is inconsistent"
            )
        self._f.write(tensor_bytes(tensor))

    @property
    def finished(self) -> bool:
        return not self._pending


def write_file(
    path: str, entries: Sequence[TensorEntry], tensors: Iterable[torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Write one safetensors file (temporary name, fsynced, renamed into place); return the tensor bytes."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        w = FileWriter(f, entries, metadata)
        source = iter(tensors)
        for entry in entries:
            tensor = next(source)  # one tensor alive at a time: the previous one is gone before the next is read
            w.write(entry.name, tensor)
            del tensor
        f.flush()
        os.fsync(f.fileno())
    return sum(e.nbytes for e in entries)


def write_set(
    out_dir: str,
    entries: Sequence[TensorEntry],
    tensors: Iterator[torch.Tensor],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write a Hugging Face-style set into the new directory ``out_dir``: shard files, then the index last.

    ``tensors`` yields the tensors in ``entries`` order, one at a time (the caller bounds memory). The set is
    built in a temporary sibling directory and renamed to ``out_dir`` when complete, so ``out_dir`` never holds
    half a set. Returns the shard file names.
    """
    if os.path.lexists(out_dir):
        raise CheckpointError(f"{out_dir} already exists; choose a new directory")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SafetensorsError(f"two tensors would have the same name in the set: {', '.join(dup[:5])}")
    groups = plan_shards(entries, max_shard_bytes)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    files = [shard_file_name(i + 1, len(groups)) for i in range(len(groups))]
    try:
        for name, group in zip(files, groups, strict=True):
            write_file(os.path.join(tmp_dir, name), group, (next(tensors) for _ in group), metadata)
        index = index_document(list(zip(files, groups, strict=True)), metadata)
        with atomic_file(os.path.join(tmp_dir, INDEX_FILE)) as tmp, open(tmp, "wb") as f:
            f.write(index_bytes(index))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp_dir)
        os.rename(tmp_dir, out_dir)
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return files


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Located:
    entry: TensorEntry
    file: str
    start: int
    """Absolute byte offset of the tensor's data in ``file``."""


class SafetensorsSource:
    """The tensors of one safetensors file or of a set (a directory with the index, or a list of files);
    headers are parsed up front, each tensor is read by its byte range."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._tensors: dict[str, _Located] = {}
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_FILE)
            if os.path.exists(index):
                files = self._index_files(index)
            else:
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
                if not files:
                    raise SafetensorsError(f"{path} holds no {INDEX_FILE} and no .safetensors files")
        elif os.path.isfile(path):
            files = [self.path]
        else:
            raise SafetensorsError(f"{path}: no such file or directory")
        for file in files:
            for located in _parse_header(file):
                if located.entry.name in self._tensors:
                    raise SafetensorsError(
                        f"{located.entry.name} is in both {self._tensors[located.entry.name].file} and {file}"
                    )
                self._tensors[located.entry.name] = located

    def _index_files(self, index: str) -> list[str]:
        files = []
        for name in dict.fromkeys(read_weight_map(index).values()):
            full = os.path.join(os.path.dirname(index), name)
            if not os.path.isfile(full):
                raise SafetensorsError(f"{index} lists {name}, which is missing")
            files.append(full)
        return files

    def entries(self) -> list[TensorEntry]:
        """Every tensor, in file order then header order (the order they were written)."""
        return [loc.entry for loc in self._tensors.values()]

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read by its byte range into memory it owns."""
        loc = self._tensors.get(name)
        if loc is None:
            raise KeyError(f"{name} is not in {self.path}")
        nbytes = loc.entry.nbytes
        buf = bytearray(nbytes)
        with open(loc.file, "rb") as f:
            f.seek(loc.start)
            if f.readinto(buf) != nbytes:
                raise SafetensorsError(f"{loc.file} is truncated: {name} needs bytes up to {loc.start + nbytes}")
        if nbytes == 0:
            return torch.empty(loc.entry.shape, dtype=loc.entry.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(loc.entry.dtype).reshape(loc.entry.shape)


def check_file(file: str) -> list[TensorEntry]:
    """The tensors of the safetensors file ``file``, after the checks its format allows without reading the data
    (what the ``safetensors`` package checks when it opens a file): the header is parsed and fits in the file,
    every tensor's byte range holds its dtype and shape and lies inside the file, and the ranges cover the data
    exactly, without gaps or overlaps. SafetensorsError naming the file and what is wrong."""
    located = _parse_header(file)
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    expected = 8 + n
    for loc in located:  # sorted by offset
        if loc.start != expected:
            what = "overlaps the one before it" if loc.start < expected else "leaves a gap before it"
            raise SafetensorsError(f"{file} has an invalid safetensors header: {loc.entry.name}'s data {what}")
        expected += loc.entry.nbytes
    if expected != size:
        raise SafetensorsError(
            f"{file} has {size} bytes but its header describes {expected}"
            + (" (the data ends before the file does)" if expected < size else "")
        )
    return [loc.entry for loc in located]


def read_weight_map(index: str) -> dict[str, str]:
    """The ``weight_map`` of the index file ``index`` (tensor name -> file name in the index's directory);
    SafetensorsError naming the file when it is not an index or maps a tensor to anything but a ``.safetensors``
    file of its directory."""
    try:
        with open(index) as f:
            doc = json.load(f)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SafetensorsError(f"{index} is not a safetensors index ({e})") from e
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or name.startswith(".") or not re.fullmatch(r"[^/\\]+\.safetensors", name):
            raise SafetensorsError(f"{index} maps {tensor} to {name!r}, which is no .safetensors file of its folder")
    return weight_map


def _parse_header(file: str) -> list[_Located]:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{file} is not a safetensors file (header length {n} for a {size}-byte file)")
        raw = f.read(n)
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise TypeError("header is not an object")
        out = []
        for name, info in doc.items():
            if name == "__metadata__":
                continue
            dtype = _FROM_CODE.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{name} has dtype {info['dtype']!r}, which torch here cannot hold")
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(name, dtype, shape)
            if end - begin != entry.nbytes or begin < 0:
                raise ValueError(f"{name}: data_offsets {[begin, end]} do not hold its {entry.nbytes} bytes")
            if 8 + n + end > size:
                raise ValueError(
                    f"{name}: data_offsets {[begin, end]} point past the end of the {size}-byte file (truncated?)"
                )
            out.append((begin, _Located(entry, file, 8 + n + begin)))
    except (ValueError, KeyError, TypeError) as e:
        raise SafetensorsError(f"{file} has an invalid safetensors header: {e}") from e
    return [loc for _, loc in sorted(out, key=lambda x: x[0])]
