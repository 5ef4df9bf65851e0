"""The model state of a checkpoint as one safetensors file, written one tensor at a time (bounded memory).

Merging is possible where it needs no knowledge the checkpoint lacks: TP=1 (pipeline stages hold disjoint
parameters, so their model files are unioned). With TP>1 each parameter is split along a dimension that depends
on the layer type (column- or row-parallel), and NxD's checkpoints do not record it, so those are refused.
The safetensors format (an 8-byte little-endian header length, a JSON header with dtype, shape and
data_offsets per tensor, then the bytes) is written here directly: it needs no extra dependency.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.inspect import Checkpoint, ObjectInfo
from nxd_ckpt.storage import LocalStorage

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}


class ExportNotSupportedError(CheckpointError):
    """The checkpoint's layout cannot be merged into one state without information it does not hold."""


@dataclass
class ExportReport:
    out: str
    tensors: int = 0
    nbytes: int = 0
    skipped: list[str] = field(default_factory=list)
    """Object paths of non-tensor values, which safetensors cannot hold."""


def model_objects(ckpt: Checkpoint) -> list[tuple[str, ObjectInfo]]:
    """(name in the merged state, object) for every model leaf; raises where merging is not possible."""
    lay = ckpt.layout()
    model_files = [sf for sf in ckpt.state_files() if sf.prefix.startswith(layout.MODEL_DIR + "/")]
    if not model_files:
        raise FormatError(f"{ckpt.url} holds no model state (no files under {layout.MODEL_DIR}/)")
    if (lay.tp or 1) > 1:
        raise ExportNotSupportedError(
            f"{ckpt.url} was saved with TP={lay.tp}: each model file holds one tensor-parallel shard, and merging "
            "shards needs the dimension each parameter was split along (column- or row-parallel), which NxD "
            "checkpoints do not record. Export one shard's state with --shard model/tp00_pp00, or load the "
            "checkpoint into the TP model and gather the full parameters there."
        )
    merged: dict[str, ObjectInfo] = {}
    origin: dict[str, str] = {}
    for sf in model_files:
        for obj in ckpt.objects(sf):
            name = obj.path[len(sf.prefix) + 1 :]
            if name in merged:
                raise ExportNotSupportedError(
                    f"{ckpt.url}: {name!r} is in both {origin[name]} and {sf.prefix}; pipeline stages should hold "
                    "disjoint parameters, so these cannot be merged into one state"
                )
            merged[name], origin[name] = obj, sf.prefix
    return list(merged.items())


def shard_objects(ckpt: Checkpoint, prefix: str) -> list[tuple[str, ObjectInfo]]:
    """(name, object) for every leaf of one state file, e.g. ``model/tp01_pp00``."""
    sf = next((s for s in ckpt.state_files() if s.prefix == prefix), None)
    if sf is None:
        names = ", ".join(s.prefix for s in ckpt.state_files())
        raise FormatError(f"{ckpt.url} has no state file {prefix!r}; it has: {names}")
    return [(obj.path[len(sf.prefix) + 1 :] or obj.path, obj) for obj in ckpt.objects(sf)]


def export_safetensors(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    *,
    shard: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the model state (or one state file, ``shard``) to ``out`` as safetensors; durable and atomic
    (a temporary file renamed into place). ``progress`` is called with bytes written."""
    objects = model_objects(ckpt) if shard is None else shard_objects(ckpt, shard)
    out = os.path.abspath(os.fspath(out))
    report = ExportReport(out=out)
    tensors = []
    header: dict[str, dict] = {"__metadata__": {"format": "pt", "nxd_ckpt_source": ckpt.url}}
    offset = 0
    for name, obj in objects:
        if obj.kind != "tensor":
            report.skipped.append(obj.path)
            continue
        dtype = SAFETENSORS_DTYPES.get(obj.dtype or "")
        if dtype is None:
            raise ExportNotSupportedError(f"{obj.path} has dtype {obj.dtype}, which safetensors cannot store")
        header[name] = {"dtype": dtype, "shape": list(obj.shape or ()), "data_offsets": [offset, offset + obj.nbytes]}
        tensors.append((name, obj))
        offset += obj.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned, as safetensors' writer does
    target = LocalStorage(os.path.dirname(out))
    with target.open_write(os.path.basename(out)) as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, obj in tensors:
            tensor = ckpt.read(obj.path)
            if tuple(tensor.shape) != tuple(obj.shape or ()) or tensor.numel() * tensor.element_size() != obj.nbytes:
                raise FormatError(f"{obj.path} read back as {tuple(tensor.shape)}, manifest says {obj.shape}")
            f.write(_little_endian_bytes(tensor))
            report.tensors += 1
            report.nbytes += obj.nbytes
            if progress is not None:
                progress(obj.nbytes)
    return report


def _little_endian_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (this host is little-endian, as safetensors requires)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
