"""ZeRO-1 optimizer files read and written one shard tensor at a time, so memory stays about one parameter.

Plain ``torch.save`` files on local disk are memory-mapped (the zip records torch wrote are mapped straight into
tensors, no copy) and the pages a tensor used are handed back to the kernel once it has been copied, so the
process never holds more than the rows in flight. xser files are naturally per tensor: only the tensor files a
shard needs are read. Other storage backends fall back to reading a whole plain file (one at a time).

Used by the offline converter (``tools/convert_zero1.py``) and by ``load_checkpoint`` when the DP size changed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from nxd_ckpt import pages, statefile, tree
from nxd_ckpt.errors import FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.load import zero1
from nxd_ckpt.load.zero1 import EntryPath
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.serialization import torchzip, xser
from nxd_ckpt.storage import Storage
from nxd_ckpt.storage.local import publish, temp_name


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a tensor that lives in a *file* mapping (``pages.drop``). Never call it on
    ordinary memory: MADV_DONTNEED zeroes anonymous pages."""
    storage = tensor.untyped_storage()
    addr, nbytes = storage.data_ptr(), storage.nbytes()
    if addr and nbytes:
        pages.drop(addr, addr + nbytes)


def map_torch_file(local_path: str, *, shared: bool = False, trusted: bool = False, what: str | None = None) -> Any:
    """Load a ``torch.save`` zip file with every tensor backed by one mapping of the file (nothing is read
    until used). ``shared=True`` maps it writable and shared, so writes land in the file. Returns None for
    files that are not in torch's zip format (the caller then loads them normally)."""
    what = what or local_path
    with open(local_path, "rb") as f:
        try:
            reader = torch._C.PyTorchFileReader(f)
            pickled = reader.get_record("data.pkl")
        except RuntimeError:
            return None
        size = os.fstat(f.fileno()).st_size
        whole = torch.UntypedStorage.from_file(local_path, shared, size)

        def source(key: str, dtype: torch.dtype, nbytes: int) -> torch.UntypedStorage:
            offset = reader.get_record_offset(f"data/{key}")
            if offset + nbytes > size:
                raise FormatError(f"{what} is truncated: tensor data {key} ends past the end of the file")
            return whole[offset : offset + nbytes]

        return torchzip.load_records(pickled, source, what=what, trusted=trusted)


class ShardFile:
    """One ZeRO-1 optimizer state file (a DP shard or a full file), read one tensor at a time."""

    def __init__(self, storage: Storage, path: str, *, trusted: bool = False) -> None:
        self.storage, self.path, self.trusted = storage, path, trusted
        self.what = f"{storage.url}/{path}"
        if not storage.exists(path):
            raise FormatError(f"ZeRO-1 optimizer file {self.what} is missing")
        self.is_xser = statefile.is_xser_file(storage, path)
        self.mapped = False
        self.info: dict[int, dict[str, Any]] | None = None
        if self.is_xser:
            self.structure, self.info = statefile.read_xser_reference(storage, path, trusted=trusted)
        else:
            state = None
            # memory-mapped where the storage allows reading the file directly (local disk, no checksum to check)
            local = storage.local_path(path)
            if local is not None:
                state = map_torch_file(local, trusted=trusted, what=self.what)
                self.mapped = state is not None
            if state is None:
                state = statefile.read_plain(storage, path, trusted=trusted)
            self.structure = state
        if not zero1.is_zero1_state(self.structure):
            keys = sorted(map(str, self.structure)) if isinstance(self.structure, dict) else None
            raise FormatError(
                f"{self.what} is not a ZeRO-1 optimizer state (no 'base_state'/'shape_info'; keys {keys}); "
                "only checkpoints saved with a ZeRO-1 optimizer (zero1_optimizer=True) can be re-sharded"
            )
        self.shapes = zero1.full_shapes(self.structure, self.what)
        self._metas: dict[EntryPath, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.shard_paths: dict[EntryPath, Any] = {}
        for path_, index, value in zero1.iter_shard_entries(self.structure):
            dtype, shape = xser.tensor_meta(value, self.info, self._load_tid)
            if zero1.is_shard_slot(path_, len(shape)):
                self.shard_paths[path_] = index
                self._metas[path_] = (dtype, shape)

    def _load_tid(self, tid: int) -> torch.Tensor:
        tensor_path = layout.xser_tensor_file(self.path, tid)
        if not self.storage.exists(tensor_path):
            raise FormatError(
                f"tensor file {self.storage.url}/{tensor_path} is missing, but {self.what} refers to it; "
                "the checkpoint is incomplete or damaged"
            )
        with self.storage.open_read(tensor_path) as f:
            tensor = xser.load_tensor(f, what=f"{self.storage.url}/{tensor_path}")
        xser.check_against_info(tid, tensor, self.info, what=f"{self.storage.url}/{tensor_path}")
        return tensor

    def meta(self, path: EntryPath) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of the shard at ``path`` (without reading its data)."""
        return self._metas[path]

    def tensor(self, path: EntryPath) -> torch.Tensor:
        """The tensor at ``path``: a view of the mapping (plain) or its tensor file, read now (xser)."""
        value = zero1.get_path(self.structure, path)
        return value if isinstance(value, torch.Tensor) else self._load_tid(int(value.tid))

    def done_with(self, tensor: torch.Tensor) -> None:
        """Give back the memory a tensor from ``tensor`` used (pages of the mapping; xser tensors are freed by
        dropping them)."""
        if self.mapped:
            release_pages(tensor)

    def check(self, dp: int) -> None:
        """Raise FormatError if a shard's shape does not fit ``shape_info`` for DP size ``dp`` (1 = full)."""
        for path_, index in self.shard_paths.items():
            zero1.check_shard_shape(self.what, path_, index, self._metas[path_][1], self.shapes, dp)

    def check_same_layout(self, other: ShardFile) -> None:
        """Raise FormatError unless ``other`` (another DP rank's shard) has the same parameters and slots."""
        if other.shapes != self.shapes or set(other.shard_paths) != set(self.shard_paths):
            raise FormatError(
                f"{other.what} and {self.what} disagree on the parameters (shape_info or state keys); the shards "
                "do not belong to the same optimizer"
            )

    def small_state(self) -> dict:
        """The state without its shards: every shard slot is None, everything else (``step``, param_groups,
        shape_info, ...) is loaded and copied out of the file."""
        shard_slots = set(self.shard_paths)

        def walk(obj: Any, path: EntryPath) -> Any:
            if path in shard_slots:
                return None
            items = tree.children(obj)
            if items is not None:
                return tree.rebuild(obj, [(k, walk(v, (*path, k))) for k, v in items])
            if isinstance(obj, torch.Tensor):
                return obj.clone()
            if xser.is_reference(obj):
                return self._load_tid(int(obj.tid))
            return obj

        return walk(self.structure, ())


# --------------------------------------------------------------------------------------------- source sets


def source_paths(tag: str, tp: int, pp: int, src_dp: int | None) -> list[str]:
    """The optimizer files of one (TP, PP) coordinate: the DP shards in order, or ``[full file]`` for None."""
    if src_dp is None:
        return [layout.full_optim_file(tag, tp, pp)]
    return [layout.optim_file(tag, d, tp, pp) for d in range(src_dp)]


def check_present(storage: Storage, paths: Iterable[str]) -> None:
    """Raise FormatError naming every missing file."""
    missing = [p for p in paths if not storage.exists(p)]
    if missing:
        shown = ", ".join(f"{storage.url}/{p}" for p in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise FormatError(f"ZeRO-1 optimizer shard files are missing: {shown}{more}; the checkpoint is incomplete")


def fill_slot(
    path: EntryPath,
    rows: int,
    sources: Sequence[ShardFile],
    src_tensors: dict[int, torch.Tensor],
    dst_dp: int,
    dst_rank: int,
    out: torch.Tensor,
) -> None:
    """Copy into ``out`` (target shard ``dst_rank`` of ``dst_dp`` at ``path``) the rows the source shards hold;
    source tensors are read on first use and kept in ``src_tensors`` for the other targets of this slot."""
    src_dp = len(sources)
    pieces = zero1.slice_plan(rows, src_dp, dst_dp, dst_rank)
    for p in pieces:
        if p.src_rank not in src_tensors:
            src_tensors[p.src_rank] = sources[p.src_rank].tensor(path)
    zero1.assemble(pieces, src_tensors, out)


def release_all(sources: Sequence[ShardFile], src_tensors: dict[int, torch.Tensor]) -> None:
    for rank, t in src_tensors.items():
        sources[rank].done_with(t)
    src_tensors.clear()


# --------------------------------------------------------------------------------------------- online load


def load_resharded_state(storage: Storage, tag: str, src_dp: int | None, topo: Topology, *, trusted: bool) -> dict:
    """This rank's ZeRO-1 optimizer state for the current DP size, built from a checkpoint saved with DP size
    ``src_dp`` (None: a full, converted checkpoint). Only the source rows the new shard covers are read."""
    paths = source_paths(tag, topo.tp_rank, topo.pp_rank, src_dp)
    check_present(storage, paths)
    n_src = len(paths)
    first = ShardFile(storage, paths[0], trusted=trusted)
    first.check(n_src)
    out = first.small_state()
    plans = {}
    for path, index in first.shard_paths.items():
        dtype, _ = first.meta(path)
        rows = first.shapes[index][0]
        target = torch.zeros(zero1.shard_shape(first.shapes[index], topo.zero1_size), dtype=dtype)
        zero1.set_path(out, path, target)
        plans[path] = zero1.slice_plan(rows, n_src, topo.zero1_size, topo.zero1_rank)
    needed = sorted({p.src_rank for pieces in plans.values() for p in pieces})
    for src_rank in needed:
        f = first if src_rank == 0 else ShardFile(storage, paths[src_rank], trusted=trusted)
        if f is not first:
            first.check_same_layout(f)
            f.check(n_src)
        for path, pieces in plans.items():
            mine = [p for p in pieces if p.src_rank == src_rank]
            if not mine:
                continue
            src = f.tensor(path)
            target = zero1.get_path(out, path)
            for p in mine:
                target[p.dst_start : p.dst_start + p.rows].copy_(src[p.src_start : p.src_stop])
            f.done_with(src)
            del src
    return out


# --------------------------------------------------------------------------------------------- writers


class PlainShardWriter:
    """Writes one plain ``torch.save`` state file whose big tensors are filled in one at a time.

    The file is first saved with ``torch.serialization.skip_data`` (structure and reserved, unwritten space),
    then mapped shared and writable; each slot is filled and its pages handed back, so the whole state is never
    in memory. The file appears under its final name only on ``commit`` (tmp name, fsync, rename).
    """

    def __init__(self, final_path: str, skeleton: Any, slots: Iterable[EntryPath]) -> None:
        self.final_path = final_path
        directory = os.path.dirname(final_path)
        os.makedirs(directory, exist_ok=True)
        self.tmp_path = temp_name(final_path)
        with torch.serialization.skip_data():
            torch.save(skeleton, self.tmp_path)
        mapped = map_torch_file(self.tmp_path, shared=True, what=self.tmp_path)
        if mapped is None:  # pragma: no cover - torch always writes its zip format here
            raise FormatError(f"could not map {self.tmp_path} for writing")
        self.state = mapped
        _copy_small_tensors(skeleton, self.state, set(slots))  # skip_data skipped these too

    def target(self, path: EntryPath) -> torch.Tensor:
        return zero1.get_path(self.state, path)

    def done_with(self, tensor: torch.Tensor) -> None:
        release_pages(tensor)

    def fill(self, path: EntryPath, fill: Callable[[torch.Tensor], Any]) -> int:
        """Let ``fill`` write slot ``path`` in place (in the mapped file); return its bytes."""
        target = self.target(path)
        fill(target)
        self.done_with(target)
        return target.numel() * target.element_size()

    def commit(self) -> None:
        self.state = None
        publish(self.tmp_path, self.final_path)

    def abort(self) -> None:
        self.state = None
        with contextlib.suppress(OSError):
            os.unlink(self.tmp_path)


class XserShardWriter:
    """Writes one xser state file: reference and info files first, then each tensor file as it is filled."""

    def __init__(self, storage: Storage, path: str, skeleton: Any) -> None:
        self.storage, self.path = storage, path
        ref_data, tensors = xser.encode(skeleton)
        self._tids = {id(t): tid for tid, t in enumerate(tensors)}
        self._skeleton = skeleton
        storage.delete_tree(layout.xser_tensors_dir(path))
        with storage.open_write(layout.xser_info_file(path)) as f:
            xser.save_info(xser.make_info(tensors), f)
        self._ref_data = ref_data
        self._written: set[int] = set()
        self._small = tensors

    def tid(self, path: EntryPath) -> int:
        return self._tids[id(zero1.get_path(self._skeleton, path))]

    def fill(self, path: EntryPath, fill: Callable[[torch.Tensor], Any]) -> int:
        """Let ``fill`` write slot ``path`` (into a tensor of the skeleton's dtype and shape), then write its
        tensor file; return its bytes."""
        like = zero1.get_path(self._skeleton, path)
        out = torch.empty(like.shape, dtype=like.dtype)
        fill(out)
        self.write_tensor(path, out)
        return out.numel() * out.element_size()

    def write_tensor(self, path: EntryPath, tensor: torch.Tensor) -> None:
        tid = self.tid(path)
        with self.storage.open_write(layout.xser_tensor_file(self.path, tid)) as f:
            xser.save_tensor(tensor, f)
        self._written.add(tid)

    def commit(self) -> None:
        """Write the tensors not filled slot by slot (``step`` and the like), then the reference file last."""
        for tid, t in enumerate(self._small):
            if tid not in self._written:
                with self.storage.open_write(layout.xser_tensor_file(self.path, tid)) as f:
                    xser.save_tensor(t, f)
        with self.storage.open_write(self.path) as f:
            xser.save_ref(self._ref_data, f)

    def abort(self) -> None:
        pass


@contextlib.contextmanager
def shard_writers(
    storage: Storage,
    paths: Sequence[str],
    small: dict,
    slots: dict[EntryPath, tuple[torch.dtype, tuple[int, ...]]],
    *,
    use_xser: bool,
) -> Iterator[list[PlainShardWriter | XserShardWriter]]:
    """One writer per ZeRO-1 state file in ``paths`` (each from ``skeleton(small, slots)``), committed together
    when the block ends, all aborted if it raises (no partial file under a final name)."""
    writers: list[PlainShardWriter | XserShardWriter] = []
    try:
        for path in paths:
            sk = skeleton(small, slots)
            if use_xser:
                writers.append(XserShardWriter(storage, path, sk))
            else:
                writers.append(PlainShardWriter(os.path.join(storage.root, path), sk, slots))
            del sk
        yield writers
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _copy_small_tensors(src: Any, dst: Any, skip: set[EntryPath], path: EntryPath = ()) -> None:
    """Copy the values of the tensors in ``src`` outside the ``skip`` slots into the same places in ``dst``."""
    if path in skip:
        return
    items = tree.children(src)
    if items is not None:
        for k, v in items:
            _copy_small_tensors(v, dst[k], skip, (*path, k))
    elif isinstance(src, torch.Tensor):
        dst.copy_(src)


def skeleton(small_state: dict, slots: dict[EntryPath, tuple[torch.dtype, tuple[int, ...]]]) -> dict:
    """``small_state`` with each shard slot set to an uninitialised tensor of the given dtype and shape (its
    pages are never touched: only reserved address space until a writer fills the file)."""
    out = tree.nxd_containers(small_state)  # NxD's containers: lists for shape_info, plain dicts
    for path, (dtype, shape) in slots.items():
        zero1.set_path(out, path, torch.empty(shape, dtype=dtype))
    return out


def reshard_source(info: TagDescription, topo: Topology) -> tuple[bool, int | None]:
    """(whether this rank must re-shard, the checkpoint's ZeRO-1 DP size or None for full files), from the
    tag's ``format.describe`` description: re-shard when the saved DP size differs from the current."""
    if not info.zero1:
        return False, None
    if info.zero1_full:
        return True, None
    saved = info.zero1_dp_size
    return (saved is not None and int(saved) != topo.zero1_size), saved
