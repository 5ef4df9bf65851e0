"""torch Distributed Checkpoint (DCP) directories, written and read through DCP's own classes, one tensor at a time.

Writing: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` in a single process (``no_dist``) and
a planner whose ``resolve_data`` reads each tensor from its source only when DCP's writer asks for it, so one
tensor at a time is in memory. The result is an ordinary DCP checkpoint: stock ``dcp.load`` reads it into a full
state dict or into DTensors on any world size (DCP re-slices saved chunks itself). Reading: DCP's
``FileSystemReader`` metadata, then ``dcp.load`` of one tensor at a time. No process group is used or needed.

DCP's ``.metadata`` is a pickle: it is unpickled here with only torch's own classes (and ``pathlib`` paths)
allowed, so no code stored in it runs; other classes are refused unless ``allow_pickle``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nxd_ckpt.errors import CheckpointError, UnsafeCheckpointError
from nxd_ckpt.format import layout

_SAFE_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "Path"),
}


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


class DcpError(CheckpointError):
    """A directory that is not a DCP checkpoint, or a tensor it does not hold."""


def write_dcp(
    out_dir: str,
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    read: Callable[[str], torch.Tensor],
) -> None:
    """Write a DCP checkpoint of the tensors ``entries`` (name, dtype, shape) into the new directory ``out_dir``.

    ``read(name)`` is called once per tensor, when DCP's writer reaches it, and must return a tensor that owns
    its memory (released once written: never a live parameter). The checkpoint is built in a
    temporary sibling directory and renamed into place once DCP has written its ``.metadata`` (last, as DCP does).
    """
    if os.path.lexists(out_dir):
        raise CheckpointError(f"{out_dir} already exists; choose a new directory")
    dcp = _dcp()
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    expected = {name: (dtype, tuple(shape)) for name, dtype, shape in entries}

    class _ReadOnDemand(DefaultSavePlanner):
        """DCP's default planner, with each tensor read from the source when the writer needs its bytes.

        DCP's file writer keeps every tensor it wrote until the file is closed (``tensor_dict``, used for its
        safetensors format); with one tensor in flight at a time (one thread, serial loader), the previous
        tensor's bytes are on disk when the next is asked for, so its memory is released then.
        """

        previous: torch.Tensor | None = None

        def release(self) -> None:
            if self.previous is not None:
                self.previous.untyped_storage().resize_(0)
                self.previous = None

        def resolve_data(self, write_item: Any) -> Any:
            name = write_item.index.fqn
            self.release()
            if name not in expected:
                return super().resolve_data(write_item)
            tensor = read(name)
            if not tensor.untyped_storage().resizable():  # e.g. over a bytes buffer: take memory we can release
                tensor = tensor.clone()
            self.previous = tensor
            if (tensor.dtype, tuple(tensor.shape)) != expected[name]:
                raise CheckpointError(
                    f"{name} came out as {tensor.dtype} {list(tensor.shape)}, but its source describes it as "
                    f"{expected[name][0]} {list(expected[name][1])}; the source checkpoint is inconsistent"
                )
            return tensor

    placeholders = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in expected.items()}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        writer = dcp.FileSystemWriter(tmp_dir, single_file_per_rank=True, sync_files=True, thread_count=1)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            planner = _ReadOnDemand()
            try:
                dcp.save(placeholders, storage_writer=writer, planner=planner, no_dist=True)
            finally:
                planner.release()
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


class DcpSource:
    """The tensors of a DCP checkpoint directory, each read whole (DCP assembles it from its saved chunks)."""

    def __init__(self, path: str, *, allow_pickle: bool = False) -> None:
        self.path = os.path.abspath(path)
        meta_file = os.path.join(self.path, layout.DCP_METADATA_FILE)
        if not os.path.isfile(meta_file):
            raise DcpError(f"{path} is not a DCP checkpoint: it has no {layout.DCP_METADATA_FILE} file")
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._allow_pickle = allow_pickle
        self._metadata = self._reader().read_metadata()
        self._tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.non_tensors: list[str] = []
        for name, md in self._metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self._tensors[name] = (md.properties.dtype, tuple(md.size))
            else:
                self.non_tensors.append(name)

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, global shape) of every tensor, in the order DCP's metadata lists them."""
        return [(name, dtype, shape) for name, (dtype, shape) in self._tensors.items()]

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor, read through ``dcp.load`` (only the byte ranges of its chunks are read)."""
        if name not in self._tensors:
            raise KeyError(f"{name} is not a tensor of the DCP checkpoint {self.path}")
        dtype, shape = self._tensors[name]
        out = {name: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            _dcp().load(out, storage_reader=self._reader(), no_dist=True)
        return out[name]

    def read_value(self, name: str) -> Any:
        """A non-tensor value DCP saved as bytes (``torch.save``), unpickled with torch's safe loader (DCP's own
        loader would run any pickled code)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        if not isinstance(self._metadata.state_dict_metadata.get(name), BytesStorageMetadata):
            raise KeyError(f"{name} is not a value (bytes) entry of the DCP checkpoint {self.path}")
        found = [info for index, info in self._metadata.storage_data.items() if index.fqn == name]
        if len(found) != 1 or getattr(found[0], "transform_descriptors", None):
            raise DcpError(f"{self.path}: {name!r} is stored in a way this reader does not handle ({found})")
        info = found[0]
        file = os.path.join(self.path, info.relative_path)
        if os.path.dirname(os.path.normpath(file)) != self.path:
            raise DcpError(f"{self.path}: {name!r} names a file outside the checkpoint ({info.relative_path})")
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise DcpError(f"{file} is truncated: {name!r} needs bytes up to {info.offset + info.length}")
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self.path}: value {name!r} holds pickled classes safe loading refuses ({str(e).splitlines()[0]})"
            ) from e

    def read_tree(self, top: str) -> Any:
        """The value DCP flattened from the top-level key ``top`` (e.g. a ``param_groups`` list of dicts), rebuilt
        from the metadata's key paths (``planner_data``) and its bytes entries (``read_value``)."""
        paths = getattr(self._metadata, "planner_data", None) or {}
        leaves = [(tuple(path), fqn) for fqn, path in paths.items() if path and path[0] == top]
        if not leaves:
            raise KeyError(f"{top} is not in the DCP checkpoint {self.path}")
        root: dict[Any, Any] = {}
        for path, fqn in leaves:
            node = root
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = self.read_value(fqn)

        def rebuild(node: Any) -> Any:
            if not isinstance(node, dict):
                return node
            if node and all(isinstance(k, int) for k in node):
                return [rebuild(node[i]) for i in sorted(node)]
            return {k: rebuild(v) for k, v in node.items()}

        return rebuild(root[top])

    def _reader(self) -> Any:
        """DCP's FileSystemReader, its ``.metadata`` unpickled with torch's classes only (unless allowed)."""
        dcp = _dcp()
        if self._allow_pickle:
            return dcp.FileSystemReader(self.path)
        meta_file = os.path.join(self.path, layout.DCP_METADATA_FILE)

        class _Reader(dcp.FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                from torch.distributed.checkpoint.metadata import StorageMeta

                with open(meta_file, "rb") as f:
                    metadata = unpickle_metadata(f, meta_file)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return _Reader(self.path)


def unpickle_metadata(f: Any, where: str, *, allow_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` from the pickle stream ``f`` (``where`` names it in errors): only torch's own classes are
    imported (UnsafeCheckpointError otherwise), unless ``allow_pickle``."""
    return pickle.load(f) if allow_pickle else _RestrictedUnpickler(f, where).load()


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata allowing DCP's own classes, torch dtypes/layouts/sizes and paths only."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            found = super().find_class(module, name)
            if isinstance(found, type):  # DCP's metadata classes (dataclasses, enums); never a function
                return found
        if module == "torch":  # dtypes, layouts and memory formats are objects of torch, not functions
            found = getattr(torch, name, None)
            if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        raise UnsafeCheckpointError(
            f"{self._where} would import {module}.{name} when unpickled, which is not one of torch's own classes; "
            "if you trust this checkpoint, pass allow_pickle=True (--allow-pickle)"
        )
