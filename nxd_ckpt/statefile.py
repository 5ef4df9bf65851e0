"""One state file on storage, in either encoding: plain ``torch.save`` or xser (one file per tensor).

xser files are written and read by a pool of threads, one tensor file per task, largest first. A replicated
state (model, non-ZeRO optimizer) is spread over the DP replicas holding it: its tensors are binned by size so
each replica writes about 1/DP of the bytes, and the first replica also writes the reference and info files.
Replicas that load the same file read each tensor from storage once between them (``ranks.replicas``), so a DP
group reads every byte from storage once, not DP times. Replicas on different hosts (or reading storage without
a host page cache, e.g. S3) each read a share and broadcast it over gloo. Replicas on one host reading a local
or POSIX filesystem share through the page cache instead: each starts with its own share, read from the device,
then copies the others' shares from memory, which measured faster than a loopback broadcast
(``NXD_CKPT_REPLICA_READS=broadcast`` forces the broadcast).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import knobs, tree
from nxd_ckpt.device.load_targets import LoadTarget
from nxd_ckpt.errors import FormatError, StorageError
from nxd_ckpt.format import layout
from nxd_ckpt.pages import prefaulted
from nxd_ckpt.ranks.replicas import ReplicaGroup
from nxd_ckpt.serialization import plain, readinto, torchzip, xser
from nxd_ckpt.serialization.inmemory import BufferReader, allocate
from nxd_ckpt.storage import Storage
from nxd_ckpt.tree import map_tensors, tensor_bytes


def inline_below_bytes() -> int:
    """xser tensors smaller than this stay in the reference file (NXD_CKPT_XSER_INLINE_BYTES, default 64 KiB).

    torch_xla's own ``save`` keeps every CPU tensor there, and every xser reader handles that; one file per
    0-d ``step`` or 4 KiB LayerNorm vector would cost a file creation and a flush each. 0 = a file per tensor.
    """
    return knobs.xser_inline_bytes()


def replica_reads_mode() -> str:
    """How replicas on one host share a read: ``auto`` (page cache where possible) or ``broadcast``."""
    return knobs.replica_reads()


def io_threads() -> int:
    """Threads per rank for tensor-file I/O (NXD_CKPT_IO_THREADS, default 4)."""
    return knobs.io_threads()


@dataclass(frozen=True)
class WrittenFiles:
    """What one ``write_state_file`` call put on storage: the paths, and the tensor bytes in them."""

    paths: list[str]
    nbytes: int


is_xser_file = layout.is_xser_file
Path = tree.Path


HostCopy = Callable[[torch.Tensor], torch.Tensor]
"""Returns the host copy of a (device) tensor: ``device.transfer.DeviceTransfer.host``, which copies ahead on a
thread."""


def write_plain(storage: Storage, path: str, state: Any, *, host: HostCopy | None = None) -> list[str]:
    """Write ``state`` as one ``torch.save`` file (device tensors through ``host``); return the paths written."""
    if host is not None:
        state = map_tensors(state, host)
    with storage.open_write(path) as f:
        plain.save(state, f)
    return [path]


def _safe_unpickler(data: Any) -> Any:
    import torch._weights_only_unpickler as weights_only

    return weights_only.Unpickler(data, encoding="utf-8")


def read_plain(storage: Storage, path: str, *, trusted: bool = False, target: LoadTarget | None = None) -> Any:
    """Read a ``torch.save`` state file in one sequential pass (hashed as it is read when verified), its tensor
    data straight into ``target``'s tensors where given (O_DIRECT where they line up), else into fresh memory.
    Files on storage without a local page cache (S3) are read whole into one buffer and parsed there."""
    what = f"{storage.url}/{path}"
    if not trusted and (target is not None or storage.host_page_cache):  # trusted: torch.load's own unpickler
        # Fresh dicts read through the page cache, read ahead: O_DIRECT into fresh memory measured slower here.
        direct = target is not None and target.direct
        target = target if target is not None else LoadTarget({})
        with storage.open_sequential(path, direct=direct) as f:
            try:
                with torchzip.safe_globals():
                    return readinto.load_into(
                        f,
                        what=what,
                        make_unpickler=_safe_unpickler,
                        choose=target.chooser(),
                        filled=target.filled,
                    )
            except readinto.Fallback as e:
                buffer = readinto.as_array(e.data)
        return plain.load_buffer(buffer, what=what, trusted=trusted)
    if storage.whole_file_reads:
        return plain.load_buffer(storage.read_buffer(path, allocate), what=what, trusted=trusted)
    with storage.open_read(path) as f:
        return plain.load(f, what=what, trusted=trusted)


def _load_small(storage: Storage, path: str, load: Callable[[Any], Any]) -> Any:
    """``load`` of a stream of the whole file (from one whole-file read where the storage wants those)."""
    if storage.whole_file_reads:
        return load(BufferReader(storage.read_buffer(path, allocate)))
    with storage.open_read(path) as f:
        return load(f)


# ----------------------------------------------------------------------------------------------- writing


def tensors_to_write(
    state: Any, *, xser_encoding: bool = False, replicas: Sequence[int] | None = None, rank: int = 0
) -> list[torch.Tensor]:
    """The tensors ``write_state_file`` reads from ``state`` on this rank, in about the order it reads them: all of
    them for a plain file; for xser, the ones inlined in the reference file and this rank's share of the tensor
    files (``xser.replica_share``)."""
    if not xser_encoding:
        return list({id(t): t for _, t in tree.leaves(state)}.values())
    inline, files = xser.classify(state, inline_below=inline_below_bytes())
    return inline + [files[tid] for tid in xser.replica_share(files, replicas or (rank,), rank)]


def write_state_file(
    storage: Storage,
    path: str,
    state: Any,
    *,
    xser_encoding: bool = False,
    replicas: Sequence[int] | None = None,
    rank: int = 0,
    threads: int | None = None,
    host: HostCopy | None = None,
) -> WrittenFiles:
    """Write this rank's part of one state file.

    Plain: the whole ``torch.save`` file. xser: the tensor files of this rank's share of ``replicas`` (the
    global ranks holding the same state; default just ``rank``), plus the reference and info files when
    ``rank`` is the first replica. ``host`` gives the host copy of each tensor as it is written (device states).
    """
    if not xser_encoding:
        storage.delete_tree(layout.xser_tensors_dir(path))  # a stale xser directory would mark it as xser
        return WrittenFiles(write_plain(storage, path, state, host=host), tensor_bytes(state))
    replicas = tuple(replicas) if replicas else (rank,)
    if rank not in replicas:
        raise ValueError(f"rank {rank} is not one of the replicas {replicas} that hold {path}")
    ref_data, tensors = xser.encode(state, inline_below=inline_below_bytes(), host=host)
    sizes = [xser.tensor_nbytes(t) for t in tensors]
    index = replicas.index(rank)
    share = xser.replica_share(tensors, replicas, rank)
    jobs: list[tuple[str, Callable[[], None]]] = []
    if index == 0:
        jobs.append((path, lambda: _write(storage, path, lambda f: xser.save_ref(ref_data, f))))
    if index == 0 and tensors:
        # Without tensor files (every tensor inline) there is no ``.tensors`` folder, so NxD and optimum-neuron
        # read the reference file as a plain one; an info file beside it would be taken for one more state file
        # (optimum-neuron's consolidation globs ``model/dp_rank_*.pt``).
        info = xser.make_info(tensors)
        info_path = layout.xser_info_file(path)
        jobs.append((info_path, lambda: _write(storage, info_path, lambda f: xser.save_info(info, f))))
    for tid in share:
        tensor_path = layout.xser_tensor_file(path, tid)
        jobs.append((tensor_path, _tensor_writer(storage, tensor_path, tensors[tid], host)))
    # One fsync per tensor file would cost a cache flush each: local storage syncs them together at the end.
    with storage.durability_batch():
        _run_parallel(jobs, threads, f"writing {storage.url}/{path}")
    inline = xser.inline_nbytes(ref_data) if index == 0 else 0
    return WrittenFiles([p for p, _ in jobs], inline + sum(sizes[tid] for tid in share))


def _write(storage: Storage, path: str, fn: Callable[[Any], None]) -> None:
    with storage.open_write(path) as f:
        fn(f)


def _tensor_writer(storage: Storage, path: str, tensor: torch.Tensor, host: HostCopy | None) -> Callable[[], None]:
    return lambda: _write(storage, path, lambda f: xser.save_tensor(host(tensor) if host else tensor, f))


def _run_parallel(jobs: list[tuple[str, Callable[[], Any]]], threads: int | None, what: str) -> list[Any]:
    """Run the jobs on a thread pool; wait for all, then raise the first failure (naming its file)."""
    if len(jobs) <= 1 or (threads or io_threads()) == 1:
        return [fn() for _, fn in jobs]
    with ThreadPoolExecutor(max_workers=min(threads or io_threads(), len(jobs)), thread_name_prefix="nxd_io") as pool:
        futures = [(name, pool.submit(fn)) for name, fn in jobs]
        results, errors = [], []
        for name, fut in futures:
            try:
                results.append(fut.result())
            except BaseException as e:  # collected, the first is raised below
                errors.append((name, e))
                results.append(None)
    if errors:
        raise errors[0][1]
    return results


# ----------------------------------------------------------------------------------------------- reading


def read_state_file(
    storage: Storage,
    path: str,
    *,
    trusted: bool = False,
    group: ReplicaGroup | None = None,
    threads: int | None = None,
    target: LoadTarget | None = None,
) -> Any:
    """Read one state file in whichever encoding it has; xser reads are shared across ``group`` if given.
    With ``target``, tensors are read straight into the target's existing tensors where they fit."""
    if not is_xser_file(storage, path):
        return read_plain(storage, path, trusted=trusted, target=target)
    return _read_xser(storage, path, trusted, group, threads, target)


@dataclass(frozen=True)
class _Header:
    ref_data: Any
    info: dict[int, dict[str, Any]] | None
    tids: list[int]
    sizes: list[int]


def _read_xser(
    storage: Storage,
    path: str,
    trusted: bool,
    group: ReplicaGroup | None,
    threads: int | None,
    target: LoadTarget | None,
) -> Any:
    """``read_state_file`` of an xser state file (ours, NxD's or torch_xla's): onto the CPU, into ``target``'s
    tensors if given."""
    what = f"{storage.url}/{path}"
    if group is None:
        header = _read_header(storage, path, trusted)
    else:
        header = group.shared(lambda: _read_header(storage, path, trusted), what)
    parts = xser.balance(header.sizes, group.size if group else 1)
    through_page_cache = (
        group is not None and group.same_host and storage.host_page_cache and replica_reads_mode() == "auto"
    )
    if group is None:
        mine = [header.tids[i] for i in parts[0]]
    elif through_page_cache:  # every tensor, own share first: the replica second to a share hits the page cache
        mine = [header.tids[i] for k in range(group.size) for i in parts[(group.index + k) % group.size]]
    else:
        mine = [header.tids[i] for i in parts[group.index]]
    if target is not None:
        target.direct = not through_page_cache  # a replica reads these files after us: keep them cached
        _check_before_reading(target, header, what)
    loaded: dict[int, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        paths = _tid_paths(header.ref_data)
        loaded = _read_tensors(storage, path, mine, header.info, threads, target, paths, not through_page_cache)
    except BaseException as e:  # shared with the replicas before raising
        error = e
    if group is None:
        if error is not None:
            raise error
        tensors = loaded
    elif through_page_cache:
        tensors = group.agree(loaded, error, what)
    else:
        owners = [[header.tids[i] for i in part] for part in parts]
        paths = _tid_paths(header.ref_data)

        def destination(tid: int, like: torch.Tensor) -> torch.Tensor | None:
            return target.existing(paths[tid], like) if target is not None and tid in paths else None

        tensors = group.exchange(loaded, error, owners, what, destination)
    return xser.decode(header.ref_data, tensors, what=what)


def read_xser_reference(
    storage: Storage, path: str, *, trusted: bool = False
) -> tuple[Any, dict[int, dict[str, Any]] | None]:
    """An xser state file's reference data and its info file (None when absent: files of torch_xla)."""
    what = f"{storage.url}/{path}"
    try:
        ref_data = _load_small(storage, path, lambda f: xser.load_ref(f, what=what, trusted=trusted))
    except StorageError as e:
        raise FormatError(f"the xser reference file {what} cannot be read: {e}") from e
    info = None
    info_path = layout.xser_info_file(path)
    if storage.exists(info_path):
        info = _load_small(storage, info_path, lambda f: xser.load_info(f, what=f"{storage.url}/{info_path}"))
    return ref_data, info


def _read_header(storage: Storage, path: str, trusted: bool) -> _Header:
    ref_data, info = read_xser_reference(storage, path, trusted=trusted)
    tids = xser.referenced_tids(ref_data)
    sizes = []
    for tid in tids:
        entry = info.get(tid) if info is not None else None
        if isinstance(entry, dict) and "shape" in entry and isinstance(entry.get("dtype"), torch.dtype):
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
            sizes.append(numel * torch.empty((), dtype=entry["dtype"]).element_size())
        else:
            tensor_path = _tensor_file(storage, path, tid, info)
            try:
                sizes.append(storage.size(tensor_path))
            except OSError as e:
                raise _missing_tensor(storage, path, tid) from e
    return _Header(ref_data, info, tids, sizes)


def _tensor_file(storage: Storage, path: str, tid: int, info: dict[int, dict[str, Any]] | None) -> str:
    """Where tensor ``tid`` of ``path`` is read from: its own ``.tensors`` folder, except for a non-expert tensor
    of an expert-parallel file that NxD wrote only into the ``ep_rank_00`` file's folder (NxD's loader reads
    non-expert tensors from there)."""
    own = layout.xser_tensor_file(path, tid)
    shared = layout.shared_tensors_file(path)
    if shared == path:
        return own
    entry = info.get(tid) if info is not None else None
    if isinstance(entry, dict) and not entry.get("expert_model_parallel", False) and not storage.exists(own):
        return layout.xser_tensor_file(shared, tid)
    return own


def _missing_tensor(storage: Storage, path: str, tid: int) -> FormatError:
    return FormatError(
        f"tensor file {storage.url}/{layout.xser_tensor_file(path, tid)} is missing, but the reference file "
        f"{storage.url}/{path} refers to tensor {tid}; the checkpoint is incomplete or damaged"
    )


def _tid_paths(ref_data: Any) -> dict[int, Path]:
    """The path in the state of each tid's first reference."""
    out: dict[int, Path] = {}
    for path, ref in tree.leaves(ref_data, xser.is_reference):
        out.setdefault(int(ref.tid), path)
    return out


def _check_before_reading(target: LoadTarget, header: _Header, what: str) -> None:
    """Run the target's checks on the saved structure before any tensor lands in it (needs the info file's
    shapes; torch_xla's own files have none: their keys are checked after the read, as before)."""
    if header.info is None:
        return
    metas: dict[int, torch.Tensor] = {}
    for tid in header.tids:
        entry = header.info.get(tid)
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), torch.dtype):
            return
        metas[tid] = torch.empty(tuple(entry.get("shape") or ()), dtype=entry["dtype"], device="meta")
    target.check(xser.decode(header.ref_data, metas, what=what))


def _read_tensors(
    storage: Storage,
    path: str,
    tids: list[int],
    info: dict[int, dict[str, Any]] | None,
    threads: int | None,
    target: LoadTarget | None = None,
    paths: dict[int, Path] | None = None,
    direct: bool = True,
) -> dict[int, torch.Tensor]:
    def has_target(tid: int) -> bool:
        return target is not None and paths is not None and paths.get(tid) in target.tensors

    # Tensors without a target get fresh memory allocated here, from the info file's dtypes and shapes, so one
    # thread can fault in all of it ahead of the readers (a file that disagrees with its info gets its own).
    fresh = _fresh_tensors([t for t in tids if not has_target(t)], info) if storage.host_page_cache else {}

    def read_one(tid: int) -> torch.Tensor:
        tensor_path = _tensor_file(storage, path, tid, info)
        what = f"{storage.url}/{tensor_path}"
        try:
            if has_target(tid) or storage.host_page_cache:
                into_target = has_target(tid)
                where = paths[tid] if into_target and paths is not None else None
                tensor = _read_tensor_file(
                    storage, tensor_path, what, target, where, fresh.get(tid), into_target=into_target, direct=direct
                )
                if not isinstance(tensor, torch.Tensor):
                    raise FormatError(f"{what} does not hold a tensor (found {type(tensor).__name__})")
            elif storage.whole_file_reads:
                tensor = xser.load_tensor_buffer(storage.read_buffer(tensor_path, allocate), what=what)
            else:
                with storage.open_read(tensor_path) as f:
                    tensor = xser.load_tensor(f, what=what)
        except StorageError as e:
            raise _missing_tensor(storage, path, tid) from e
        xser.check_against_info(tid, tensor, info, what=what)
        return tensor

    jobs = [(str(tid), (lambda tid=tid: read_one(tid))) for tid in tids]
    with prefaulted(list(fresh.values())):
        return dict(zip(tids, _run_parallel(jobs, threads, f"reading {storage.url}/{path}"), strict=True))


def _read_tensor_file(
    storage: Storage,
    tensor_path: str,
    what: str,
    target: LoadTarget | None,
    where: Path | None,
    fresh: torch.Tensor | None,
    *,
    into_target: bool,
    direct: bool,
) -> Any:
    """One xser tensor file in one pass: into ``target``'s tensor at ``where`` where there is one, else into
    ``fresh`` (or new memory). A target slot chosen but left unfilled (a failed read, a layout read elsewhere) is
    abandoned, so that readers waiting for the target's buffers never wait for it."""
    chosen: list[torch.Tensor] = []

    def choose(meta: Any) -> dict[int, torch.Tensor]:
        if not isinstance(meta, torch.Tensor):
            return {}
        if target is not None and where is not None:
            dest = target.dest(where, meta)
            if dest is not None:
                chosen.append(dest)
                return {id(meta): dest}
            return {}
        return {id(meta): fresh} if fresh is not None else {}

    try:
        with storage.open_sequential(tensor_path, direct=direct and into_target) as f:
            try:
                result = readinto.load_into(
                    f,
                    what=what,
                    make_unpickler=xser.tensor_unpickler,
                    choose=choose,
                    filled=target.filled if target is not None and into_target else None,
                )
                fallback = None
            except readinto.Fallback as e:
                fallback = readinto.as_array(e.data)
        if fallback is not None:  # the slot stays unfilled: result_for abandons it
            result = xser.load_tensor_buffer(fallback, what=what)
    except BaseException:
        if chosen and target is not None:  # its slot will never be filled
            target.abandon(chosen[0])
        raise
    return target.result_for(result, chosen[0]) if chosen and target is not None else result


def _fresh_tensors(tids: list[int], info: dict[int, dict[str, Any]] | None) -> dict[int, torch.Tensor]:
    """Fresh CPU tensors for ``tids`` as the info file describes them (none where it says nothing usable)."""
    out: dict[int, torch.Tensor] = {}
    for tid in tids:
        entry = (info or {}).get(tid)
        if isinstance(entry, dict) and isinstance(entry.get("dtype"), torch.dtype):
            out[tid] = torch.empty(tuple(entry.get("shape") or ()), dtype=entry["dtype"])
    return out
