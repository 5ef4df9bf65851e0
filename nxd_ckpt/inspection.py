"""Looking inside a checkpoint without loading it: its files, every object's shape, dtype and bytes, and one
tensor or sub-tree read by path while touching only the files that hold it.

Object paths name a state file, then the keys down to the object, joined by ``/``::

    model/tp00_pp00/layers.3.attn.weight          model file of TP rank 0, PP rank 0 (DP rank 0)
    optim/dp01_tp00_pp00/base_state/7/exp_avg     ZeRO-1 optimizer shard of DP rank 1
    optim/full_tp00_pp00/...                      merged ZeRO-1 state written by the offline converter
    scheduler/last_epoch, user_content/step       the master's files

The manifest comes from the pickled structure alone: a plain ``torch.save`` file's ``data.pkl`` is replayed with
storages on the ``meta`` device (only the zip directory and the pickle are read), xser files from their reference
and info files.
Reading one object of an xser file opens only its reference file and that object's tensor files; of a plain
file, its pickle and then only the zip records of the wanted tensors are read (ranged reads through
``storage/range_reads.py``, so on S3 too).
Works on NxD-written
checkpoints too (their layout is the same; only ``nxd_ckpt.json`` is missing).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nxd_ckpt.errors import CheckpointNotFoundError, FormatError
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.describe import TagDescription, describe, layout_text
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.storage import Storage, storage_for
from nxd_ckpt.storage.range_reads import open_for_partial_reads

# torch and the modules needing it load on first use: listing tags and layouts never touches a tensor.
torch = lazy_module("torch")
xser = lazy_module("nxd_ckpt.serialization.xser")
structure = lazy_module("nxd_ckpt.serialization.structure")
tree = lazy_module("nxd_ckpt.tree")

__all__ = ["Checkpoint", "Layout", "ObjectInfo", "StateFile", "open_checkpoint"]

_SMALL_LIST = 64
_RANK_PART_RE = re.compile(r"([a-z]+)_rank_(\d+)")


@dataclass(frozen=True)
class ObjectInfo:
    """One leaf of a state file: a tensor (shape, dtype, bytes) or a plain value (step counts, learning rates)."""

    path: str
    """Object path, e.g. ``model/tp00_pp00/fc1.weight``."""
    kind: str
    """``"tensor"`` or ``"value"``."""
    dtype: str | None
    """Tensor dtype without the ``torch.`` prefix (``"bfloat16"``), or the Python type name of a value."""
    shape: tuple[int, ...] | None
    nbytes: int
    """Bytes of tensor data (0 for values)."""
    file: str
    """Path, relative to the checkpoint directory, of the file holding the data (an xser tensor file for xser)."""
    value: Any = None
    """The value itself for small plain values (numbers, strings, short lists), else None."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "dtype": self.dtype, "nbytes": self.nbytes}
        out["shape"] = list(self.shape) if self.shape is not None else None
        out["file"] = self.file
        if self.kind == "value":
            out["value"] = self.value
        return out


@dataclass(frozen=True)
class StateFile:
    """One state file of a tag (``model/…pt``, ``optim/…pt``, ``scheduler.pt``…) and how it is encoded."""

    path: str
    """Relative to the checkpoint directory, e.g. ``step_3/model/dp_rank_00_tp_rank_00_pp_rank_00.pt``."""
    prefix: str
    """Object path prefix of its contents, e.g. ``model/tp00_pp00``."""
    encoding: str
    """``"plain"`` (one ``torch.save`` file) or ``"xser"`` (reference file + one file per tensor)."""


@dataclass(frozen=True)
class Layout:
    """How a checkpoint was saved: parallel sizes, ZeRO-1, xser; ``None`` where the files do not tell."""

    tp: int | None
    pp: int | None
    dp: int | None
    zero1: bool
    xser: bool
    world_size: int | None = None
    items: tuple[str, ...] | None = None
    ep: int = 1
    """Expert-parallel size (model files named ``..._ep_rank_XX_...`` when above 1)."""
    zero1_full: bool = False
    """The ZeRO-1 state is merged into ``optim/full_*`` files (convert-zero1 --convert_to_full): any DP loads it."""

    @classmethod
    def from_description(cls, desc: TagDescription) -> Layout:
        """The layout facts of a tag's description (each field of ``Layout`` is the description's of that name)."""
        return cls(**{f.name: getattr(desc, f.name) for f in dataclasses.fields(cls)})

    def describe(self) -> str:
        return layout_text(self.dp, self.tp, self.pp, self.zero1, self.zero1_full, self.xser, self.ep)

    def to_json(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "zero1": self.zero1,
            "zero1_full": self.zero1_full,
            "xser": self.xser,
            "world_size": self.world_size,
            "items": list(self.items) if self.items is not None else None,
            **({"ep": self.ep} if self.ep > 1 else {}),
        }


def object_prefix(rel_path: str) -> str:
    """Object path prefix of a state file path relative to its tag: ``model/dp_rank_00_tp_rank_01_pp_rank_00.pt``
    -> ``model/tp01_pp00``, ``optim/dp_rank_01_…`` -> ``optim/dp01_tp00_pp00``, ``scheduler.pt`` -> ``scheduler``."""
    directory, _, name = rel_path.rpartition("/")
    stem = name[: -len(".pt")] if name.endswith(".pt") else name
    stem = _RANK_PART_RE.sub(r"\1\2", stem)
    if directory == layout.MODEL_DIR and stem.startswith("dp00_"):
        stem = stem[len("dp00_") :]  # model files are always DP rank 0: the DP part says nothing
    return f"{directory}/{stem}" if directory else stem


def open_checkpoint(
    checkpoint_dir: str | os.PathLike[str] | Storage,
    tag: str | None = None,
    *,
    allow_incomplete: bool = False,
    allow_pickle: bool = False,
) -> Checkpoint:
    """Open one tag of a checkpoint directory for inspection (default: the latest complete tag).

    Args:
        checkpoint_dir: a local directory, ``s3://bucket/prefix`` or a Storage.
        tag: the tag to open; None for the latest complete one.
        allow_incomplete: also open a tag without ``done`` (an interrupted save), e.g. to see what it holds.
        allow_pickle: unpickle arbitrary classes (runs code from the checkpoint: only for trusted ones).
    """
    storage = storage_for(checkpoint_dir)
    if tag is not None and allow_incomplete:
        layout.validate_tag(tag)
        if not storage.exists(layout.tag_path(tag, layout.CHECKPOINT_MARKER)) and not storage.exists(
            layout.tag_path(tag, layout.DONE_MARKER)
        ):
            known = ", ".join(t.name for t in tags.list_tags(storage, include_incomplete=True)) or "none"
            state = "is not a checkpoint (no 'checkpoint' or 'done' file)" if storage.exists(tag) else "does not exist"
            raise CheckpointNotFoundError(f"checkpoint tag {tag!r} in {storage.url} {state}; tags: {known}")
        return Checkpoint(storage, tag, allow_pickle=allow_pickle)
    return Checkpoint(storage, tags.resolve_tag(storage, tag), allow_pickle=allow_pickle)


class Checkpoint:
    """One tag of a checkpoint directory, opened for reading; nothing is loaded until asked for."""

    def __init__(self, storage: Storage, tag: str, *, allow_pickle: bool = False) -> None:
        self.storage = storage
        self.tag = layout.validate_tag(tag)
        self.allow_pickle = allow_pickle
        self._state_files: list[StateFile] | None = None
        self._xser_refs: dict[str, Any] = {}
        self._xser_infos: dict[str, dict[int, dict[str, Any]] | None] = {}
        self._structures: dict[str, Any] = {}
        self._description: TagDescription | None = None

    @property
    def url(self) -> str:
        return f"{self.storage.url}/{self.tag}"

    @property
    def complete(self) -> bool:
        return self.storage.exists(layout.tag_path(self.tag, layout.DONE_MARKER))

    @property
    def metadata(self) -> dict | None:
        """nxd_ckpt's ``nxd_ckpt.json`` of this tag as a dict (None for NxD-written tags); typed:
        ``description().metadata``."""
        meta = self.description().metadata
        return meta.to_dict() if meta is not None else None

    def files(self) -> list[tuple[str, int]]:
        """Every file of the tag as (path relative to the tag directory, size in bytes), sorted."""
        start = len(self.tag) + 1
        return [(p[start:], self.storage.size(p)) for p in self.storage.walk_files(self.tag)]

    def state_files(self) -> list[StateFile]:
        """The state files (model, optimizer, scheduler, user content, per-rank extras), model first."""
        if self._state_files is None:
            found = []
            for rel, _ in self.files():
                if not rel.endswith(".pt") or rel.endswith(layout.XSER_INFO_SUFFIX):
                    continue
                if f"{layout.XSER_TENSORS_SUFFIX}/" in rel:
                    continue
                path = layout.tag_path(self.tag, *rel.split("/"))
                encoding = "xser" if layout.is_xser_file(self.storage, path) else "plain"
                found.append(StateFile(path=path, prefix=object_prefix(rel), encoding=encoding))
            order = {layout.MODEL_DIR: 0, layout.OPTIM_DIR: 1}
            found.sort(key=lambda s: (order.get(s.prefix.split("/")[0], 2 if "/" not in s.prefix else 3), s.path))
            self._state_files = found
        return list(self._state_files)

    def description(self) -> TagDescription:
        """The saved layout (``format.describe``: the loader, ``verify`` and the tools ask the same function)."""
        if self._description is None:
            self._description = describe(self.storage, self.tag)
        return self._description

    def layout(self) -> Layout:
        """The saved layout: from ``nxd_ckpt.json``, else inferred from NxD's file names."""
        return Layout.from_description(self.description())

    # ------------------------------------------------------------------------------------------ manifest
    def objects(self, state_file: StateFile | str | None = None) -> list[ObjectInfo]:
        """The manifest: every leaf of one state file (or of all of them) without reading tensor data."""
        files = self.state_files() if state_file is None else [self._state_file(state_file)]
        out: list[ObjectInfo] = []
        for sf in files:
            out.extend(self._objects_of(sf))
        return out

    def _objects_of(self, sf: StateFile) -> list[ObjectInfo]:
        if sf.encoding == "xser":
            ref = self._xser_ref(sf)
            info = self._xser_info(sf)
            out = []
            for inner, leaf in _walk(ref):
                path = _join(sf.prefix, inner)
                if xser.is_reference(leaf) or isinstance(leaf, torch.Tensor):  # the latter kept inside the file
                    file = layout.xser_tensor_file(sf.path, int(leaf.tid)) if xser.is_reference(leaf) else sf.path
                    dtype, shape = xser.tensor_meta(leaf, info, lambda tid: self._xser_tensor_structure(sf, tid))
                    nbytes = _numel(shape) * _element_size(dtype)
                    out.append(ObjectInfo(path, "tensor", _dtype_name(dtype), shape, nbytes, file))
                else:
                    out.append(_value_info(path, leaf, sf.path))
            return out
        tree = self._plain_structure(sf)
        out = []
        for inner, leaf in _walk(tree):
            path = _join(sf.prefix, inner)
            if isinstance(leaf, torch.Tensor):
                nbytes = leaf.numel() * leaf.element_size()
                out.append(ObjectInfo(path, "tensor", _dtype_name(leaf.dtype), tuple(leaf.shape), nbytes, sf.path))
            else:
                out.append(_value_info(path, leaf, sf.path))
        return out

    # ------------------------------------------------------------------------------------------ reading
    def read(self, path: str) -> Any:
        """One tensor, value or sub-tree by object path (a state file's prefix alone reads the whole file).

        Only the files holding it are read: for xser, the reference file and the tensor files under ``path``;
        for a plain file, its pickle and the zip records of the tensors under ``path``. Tensors come back as CPU
        tensors owning their memory.
        """
        sf, inner = self._split(path)
        if sf.encoding == "xser":
            sub = _navigate(self._xser_ref(sf), inner, path, self.url)
            info = self._xser_info(sf)
            tensors = {tid: self._read_xser_tensor(sf, tid, info) for tid in xser.referenced_tids(sub)}
            return xser.decode(sub, tensors, what=f"{self.storage.url}/{sf.path}")
        sub = _navigate(self._plain_structure(sf), inner, path, self.url)
        return self._materialize(sf, sub, inner, path)

    def iter_tensors(self, state_file: StateFile | str) -> Iterator[tuple[str, torch.Tensor]]:
        """(object path, tensor) for each tensor of one state file, read one at a time (bounded memory)."""
        sf = self._state_file(state_file)
        for obj in self._objects_of(sf):
            if obj.kind == "tensor":
                yield obj.path, self.read(obj.path)

    # ------------------------------------------------------------------------------------------ internals
    def _state_file(self, state_file: StateFile | str) -> StateFile:
        if isinstance(state_file, StateFile):
            return state_file
        for sf in self.state_files():
            if state_file in (sf.path, sf.prefix, sf.path[len(self.tag) + 1 :]):
                return sf
        raise FormatError(f"{self.url} has no state file {state_file!r}; it has: {self._prefixes()}")

    def _prefixes(self) -> str:
        return ", ".join(sf.prefix for sf in self.state_files()) or "none"

    def _split(self, path: str) -> tuple[StateFile, str]:
        """The state file an object path points into, and the path inside it."""
        path = path.strip("/")
        best: StateFile | None = None
        for sf in self.state_files():
            if (path == sf.prefix or path.startswith(sf.prefix + "/")) and (
                best is None or len(sf.prefix) > len(best.prefix)
            ):
                best = sf
        if best is None:
            raise KeyError(
                f"object path {path!r} names no state file of {self.url}; paths start with one of: {self._prefixes()}"
            )
        return best, path[len(best.prefix) + 1 :]

    def _what(self, path: str) -> str:
        return f"{self.storage.url}/{path}"

    def _plain_structure(self, sf: StateFile) -> Any:
        """The unpickled structure of a plain file, tensors on the meta device (no tensor data read); cached."""
        if sf.path not in self._structures:
            with open_for_partial_reads(self.storage, sf.path) as f:
                self._structures[sf.path] = structure.load_structure(f, self._what(sf.path), self.allow_pickle)
        return self._structures[sf.path]

    def _materialize(self, sf: StateFile, sub: Any, inner: str, path: str) -> Any:
        """Real CPU tensors for the meta tensors in ``sub``: each zip record they use is read once, by range."""
        metas = [t for _, t in _walk(sub) if isinstance(t, torch.Tensor)]
        if not metas:
            return sub
        records = {getattr(t.untyped_storage(), structure.RECORD_ATTR, None) for t in metas}
        if None in records:  # a legacy (pre-zip) torch.save file: no records to read by range, load it whole
            with self.storage.open_read(sf.path) as f:
                full = structure.torch_load(f, self._what(sf.path), self.allow_pickle, map_location="cpu")
            return _navigate(full, inner, path, self.url)
        with open_for_partial_reads(self.storage, sf.path) as f:
            reader = torch._C.PyTorchFileReader(f)
            if reader.has_record("byteorder") and reader.get_record("byteorder") not in (b"little", "little"):
                raise FormatError(f"{self._what(sf.path)} was written on a big-endian machine; load it with torch.load")
            offsets = {key: reader.get_record_offset(f"data/{key}") for key in sorted(records)}
        nbytes = {getattr(t.untyped_storage(), structure.RECORD_ATTR): t.untyped_storage().nbytes() for t in metas}
        storages = {key: self._read_record(sf, offsets[key], nbytes[key]) for key in offsets}

        def real(t: torch.Tensor) -> torch.Tensor:
            storage = storages[getattr(t.untyped_storage(), structure.RECORD_ATTR)]
            out = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())
            whole = out.is_contiguous() and t.storage_offset() == 0 and out.nbytes == storage.nbytes()
            return out if whole else out.clone()

        return tree.map_tensors(sub, real)

    def _read_record(self, sf: StateFile, offset: int, nbytes: int) -> torch.UntypedStorage:
        if nbytes == 0:
            return torch.UntypedStorage(0)
        data = self.storage.read_bytes(sf.path, offset, nbytes)
        if len(data) != nbytes:
            raise FormatError(
                f"{self._what(sf.path)} is truncated: a tensor record at byte {offset} should hold {nbytes} bytes, "
                f"found {len(data)}"
            )
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage()

    def _xser_ref(self, sf: StateFile) -> Any:
        if sf.path not in self._xser_refs:
            with self.storage.open_read(sf.path) as f:
                self._xser_refs[sf.path] = xser.load_ref(f, what=self._what(sf.path), trusted=self.allow_pickle)
        return self._xser_refs[sf.path]

    def _xser_info(self, sf: StateFile) -> dict[int, dict[str, Any]] | None:
        if sf.path not in self._xser_infos:
            info_path = layout.xser_info_file(sf.path)
            info = None
            if self.storage.exists(info_path):
                with self.storage.open_read(info_path) as f:
                    info = xser.load_info(f, what=self._what(info_path))
            self._xser_infos[sf.path] = info
        return self._xser_infos[sf.path]

    def _xser_tensor_structure(self, sf: StateFile, tid: int) -> torch.Tensor:
        """One xser tensor on ``meta``, from its tensor file's pickle alone (for files without an info file)."""
        tensor_path = layout.xser_tensor_file(sf.path, tid)
        if not self.storage.exists(tensor_path):
            raise FormatError(
                f"tensor file {self._what(tensor_path)} is missing, but {self._what(sf.path)} refers to tensor "
                f"{tid}; the checkpoint is incomplete or damaged"
            )
        with open_for_partial_reads(self.storage, tensor_path) as f:
            t = structure.load_structure(f, self._what(tensor_path), False)
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{self._what(tensor_path)} does not hold a tensor (found {type(t).__name__})")
        return t

    def _read_xser_tensor(self, sf: StateFile, tid: int, info: dict[int, dict[str, Any]] | None) -> torch.Tensor:
        tensor_path = layout.xser_tensor_file(sf.path, tid)
        what = self._what(tensor_path)
        if not self.storage.exists(tensor_path):
            raise FormatError(
                f"tensor file {what} is missing, but {self._what(sf.path)} refers to tensor {tid}; the checkpoint "
                "is incomplete or damaged"
            )
        with self.storage.open_read(tensor_path) as f:
            tensor = xser.load_tensor(f, what=what)
        xser.check_against_info(tid, tensor, info, what=what)
        return tensor


# ---------------------------------------------------------------------------------------------- helpers


def _is_plain_value(obj: Any) -> bool:
    return obj is None or isinstance(obj, (bool, int, float, str))


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(inner path, leaf) depth-first; a list/tuple of plain values is one leaf (e.g. ``params: [0, 1, 2]``)."""
    items = tree.children(obj)
    if items is None or (not isinstance(obj, dict) and obj and all(_is_plain_value(v) for v in obj)):
        yield prefix, obj
        return
    if not isinstance(obj, dict) and not obj:
        yield prefix, obj
    for k, v in items:
        yield from _walk(v, f"{prefix}/{k}" if prefix else str(k))


def _join(prefix: str, inner: str) -> str:
    return f"{prefix}/{inner}" if inner else prefix


def _value_info(path: str, leaf: Any, file: str) -> ObjectInfo:
    small = _is_plain_value(leaf) or (
        isinstance(leaf, (list, tuple)) and len(leaf) <= _SMALL_LIST and all(_is_plain_value(v) for v in leaf)
    )
    value = (list(leaf) if isinstance(leaf, (list, tuple)) else leaf) if small else None
    return ObjectInfo(path, "value", type(leaf).__name__, None, 0, file, value)


def _navigate(tree: Any, inner: str, path: str, where: str) -> Any:
    """The sub-tree at ``inner`` (keys joined by '/'; a key that itself holds '/' is matched too)."""
    parts = inner.split("/") if inner else []
    node, i = tree, 0
    while i < len(parts):
        found = False
        for j in range(i + 1, len(parts) + 1):
            key = "/".join(parts[i:j])
            if isinstance(node, dict):
                match = [k for k in node if str(k) == key]
                if match:
                    node, i, found = node[match[0]], j, True
                    break
            elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
                node, i, found = node[int(key)], j, True
                break
        if not found:
            done = "/".join(parts[:i])
            here = f" under {done!r}" if done else ""
            keys = list(node)[:20] if isinstance(node, dict) else None
            hint = f"; keys there: {', '.join(map(str, keys))}" if keys else ""
            raise KeyError(f"{where} has no object {path!r}: no key {parts[i]!r}{here}{hint}")
    return node


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
