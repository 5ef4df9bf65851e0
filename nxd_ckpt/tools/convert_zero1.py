"""Offline ZeRO-1 optimizer conversion: sharded -> full, full -> sharded, sharded -> sharded with a new DP size.

Same flags and output layout as NxD's converter (``--input_dir``, ``--output_dir``, ``--dp_size``,
``--num_workers``, ``--convert_to_full`` | ``--convert_to_sharded``), but it streams: one parameter slot at a
time is copied from the (memory-mapped or per-tensor xser) source files into the target files, so the memory
peak is about one parameter's optimizer state instead of the whole merged state of a (TP, PP) coordinate.

Input and output are tag directories. The output is a complete checkpoint that ``load_checkpoint`` can use
directly: model files (xser ``.tensors`` included), scheduler, user content and per-rank extras are copied,
``nxd_ckpt.json`` records the new ZeRO-1 layout (``format.metadata``), every file is checksummed into one
manifest (so the converted tag loads verified and passes ``verify``), and ``done`` is written last, so an
interrupted run never leaves something that looks complete. xser in gives xser out; plain in gives plain out.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.format import layout, tags
from nxd_ckpt.format.describe import TagDescription, describe
from nxd_ckpt.format.metadata import TagMetadata
from nxd_ckpt.load import zero1
from nxd_ckpt.load.zero1_io import (
    ShardFile,
    check_present,
    fill_slot,
    release_all,
    shard_writers,
    source_paths,
)
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import LocalStorage, storage_for
from nxd_ckpt.tools import offline_tag

logger = logging.getLogger("nxd_ckpt.convert_zero1")


@dataclass
class ConversionReport:
    """What a conversion did: the layouts, files and bytes, and how long it took."""

    input_dir: str
    output_dir: str
    src_dp: int | None
    """DP size of the input shards (None: the input was full)."""
    dst_dp: int | None
    """DP size of the output shards (None: converted to full)."""
    tp: int
    pp: int
    xser: bool
    files_written: list[str] = field(default_factory=list)
    bytes_converted: int = 0
    files_copied: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        src = "full" if self.src_dp is None else f"DP={self.src_dp}"
        dst = "full" if self.dst_dp is None else f"DP={self.dst_dp}"
        return (
            f"converted ZeRO-1 optimizer {src} -> {dst} for TP={self.tp} PP={self.pp} "
            f"({'xser' if self.xser else 'plain'}): {len(self.files_written)} optimizer files, "
            f"{format_bytes(self.bytes_converted)}, {self.files_copied} other files carried over, "
            f"{self.seconds:.2f} s -> {self.output_dir}"
        )


@dataclass(frozen=True)
class _InputLayout:
    """The input tag as the converter reads it: its ZeRO-1 DP size (None: full), TP, PP, encoding, description."""

    src_dp: int | None
    tp: int
    pp: int
    xser: bool
    description: TagDescription

    @property
    def coordinates(self) -> list[tuple[int, int]]:
        """Every (TP, PP) coordinate, TP fastest."""
        return [(tp, pp) for pp in range(self.pp) for tp in range(self.tp)]


# --------------------------------------------------------------------------------------------- public API


def convert_zero1(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dp_size: int | None = None,
    convert_to_full: bool = False,
    convert_to_sharded: bool | None = None,
    num_workers: int = 1,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool | None = None,
) -> ConversionReport:
    """Convert the ZeRO-1 optimizer state of the tag directory ``input_dir`` into ``output_dir``.

    Args:
        input_dir: a tag directory (``.../step_1200``) with ``optim/dp_rank_..`` shards or ``optim/full_..``.
        output_dir: the tag directory to create; refused if it already holds a checkpoint, unless ``overwrite``.
        dp_size: DP size of the output shards (required unless ``convert_to_full``).
        convert_to_full: write ``optim/full_tp_rank_XX_pp_rank_YY.pt`` instead of shards.
        convert_to_sharded: the other direction (default: ``not convert_to_full``); both True is an error.
        num_workers: (TP, PP) coordinates converted in parallel (each holds about one parameter at a time).
        overwrite: replace a checkpoint already in ``output_dir``.
        allow_pickle: read files holding arbitrary pickled classes (runs code from them: trusted files only).
        progress: False hides the progress bar; otherwise it shows when stderr is a terminal (DEBUG log lines
            every ~10% elsewhere).

    Raises:
        ValueError: bad arguments (``dp_size`` missing or < 1, both or neither direction, same dirs).
        CheckpointError: the input is not a ZeRO-1 checkpoint, files are missing or inconsistent, or the output
            directory already holds a checkpoint.
    """
    if _is_remote(input_dir) or _is_remote(output_dir):
        return _convert_through_local_copy(
            os.fspath(input_dir),
            os.fspath(output_dir),
            dict(
                dp_size=dp_size,
                convert_to_full=convert_to_full,
                convert_to_sharded=convert_to_sharded,
                num_workers=num_workers,
                overwrite=overwrite,
                allow_pickle=allow_pickle,
                progress=progress,
            ),
        )
    start = time.perf_counter()
    _check_arguments(dp_size, convert_to_full, convert_to_sharded, num_workers)
    in_root, in_tag, out_root, out_tag = _input_and_output(input_dir, output_dir)
    in_dir, out_dir = os.path.join(in_root, in_tag), os.path.join(out_root, out_tag)
    if convert_to_full and dp_size is not None:
        logger.warning("--dp-size %s is ignored when converting to full", dp_size)

    in_storage = LocalStorage(in_root)
    info = _inspect_input(in_storage, in_tag, trusted=allow_pickle)
    if convert_to_full and info.src_dp is None:
        raise FormatError(f"{in_dir} already holds full optimizer states (optim/full_*.pt); nothing to convert")
    dst_dp = None if convert_to_full else dp_size
    out_storage = offline_tag.begin(out_root, out_tag, overwrite=overwrite)
    os.makedirs(os.path.join(out_dir, layout.OPTIM_DIR), exist_ok=True)
    report = ConversionReport(in_dir, out_dir, info.src_dp, dst_dp, info.tp, info.pp, info.xser)
    report.files_copied = offline_tag.carry_over(in_dir, out_dir, skip_dirs=(layout.OPTIM_DIR,))

    bar = _Progress(_count_slots(in_storage, in_tag, info, trusted=allow_pickle), enabled=progress)

    def job(coord: tuple[int, int]) -> tuple[list[str], int]:
        return _convert_coordinate(
            in_storage, in_tag, out_storage, out_tag, coord, info.src_dp, dst_dp, info.xser, allow_pickle, bar
        )

    try:
        results = _run_all(job, info.coordinates, num_workers)
    finally:
        bar.close()
    for files, nbytes in results:
        report.files_written += files
        report.bytes_converted += nbytes

    offline_tag.commit(out_storage, _metadata(out_tag, info, dst_dp))
    report.seconds = time.perf_counter() - start
    logger.info("%s", report.summary())
    return report


def _check_arguments(
    dp_size: int | None, convert_to_full: bool, convert_to_sharded: bool | None, num_workers: int
) -> None:
    """ValueError for a bad direction (both or neither), ``dp_size`` (when converting to shards) or ``num_workers``."""
    if convert_to_sharded is None:
        convert_to_sharded = not convert_to_full
    if convert_to_full == convert_to_sharded:
        raise ValueError("choose exactly one of convert_to_full / convert_to_sharded")
    if convert_to_sharded and (dp_size is None or not isinstance(dp_size, int) or dp_size < 1):
        raise ValueError(f"--dp-size (dp_size) must be an integer >= 1 when converting to shards, got {dp_size!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")


def _input_and_output(
    input_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]
) -> tuple[str, str, str, str]:
    """(input root, input tag, output root, output tag) of two local tag directories, which must differ."""
    in_root, in_tag = _split_tag_dir(input_dir, "input")
    out_root, out_tag = _split_tag_dir(output_dir, "output")
    in_dir, out_dir = os.path.join(in_root, in_tag), os.path.join(out_root, out_tag)
    if os.path.realpath(in_dir) == os.path.realpath(out_dir):
        raise ValueError(f"output_dir must differ from input_dir ({in_dir}); write the conversion to a new tag")
    return in_root, in_tag, out_root, out_tag


def _count_slots(storage: LocalStorage, tag: str, info: _InputLayout, *, trusted: bool) -> int:
    """The progress bar's total: parameter slots of every (TP, PP) coordinate (PP stages hold different ones)."""
    return sum(
        len(ShardFile(storage, source_paths(tag, tp, pp, info.src_dp)[0], trusted=trusted).shard_paths)
        for tp, pp in info.coordinates
    )


_T = TypeVar("_T")
_R = TypeVar("_R")


def _run_all(job: Callable[[_T], _R], items: list[_T], num_workers: int) -> list[_R]:
    """``job`` over ``items``, ``num_workers`` at a time; every job finishes, then the first error is raised."""
    if num_workers == 1 or len(items) == 1:
        return [job(item) for item in items]
    with ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="convert_zero1") as pool:
        futures = [pool.submit(job, item) for item in items]
        results, errors = [], []
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as e:  # all workers finish; the first error is raised
                errors.append(e)
        if errors:
            raise errors[0]
    return results


# --------------------------------------------------------------------------------------------- input / output


def _relative(root: str, path: str) -> str:
    """``path`` (under ``root``) as a storage key."""
    return os.path.relpath(path, root).replace(os.sep, "/")


def _is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether the tag directory is on storage this host cannot read as files (the storage says: S3 and any
    other backend without local paths)."""
    return storage_for(os.fspath(path)).local_path("") is None


def _split_url(url: str, role: str) -> tuple[str, str]:
    """(checkpoint dir, tag) of a tag directory given as a local path or an ``s3://bucket/prefix/tag`` URL."""
    if not _is_remote(url):
        return _split_tag_dir(url, role)
    root, _, tag = url.rstrip("/").rpartition("/")
    try:
        layout.validate_tag(tag)
    except CheckpointError as e:
        raise ValueError(f"{role} {url} must be a tag directory with a plain name: {e}") from e
    return root, tag


def _convert_through_local_copy(input_dir: str, output_dir: str, options: dict) -> ConversionReport:
    """Convert a tag on S3 (or into S3): stream the input tag to a local scratch directory, convert there with
    the same bounded-memory code, then upload the output with ``done`` last. Scratch space is local disk, so
    host memory stays at about one parameter's optimizer state whatever the size of the tag."""
    import tempfile

    in_root, in_tag = _split_url(input_dir, "input")
    out_root, out_tag = _split_url(output_dir, "output")
    in_storage, out_storage = storage_for(in_root), storage_for(out_root)
    out_is_checkpoint = out_storage.exists(layout.tag_path(out_tag, layout.CHECKPOINT_MARKER)) or out_storage.exists(
        layout.tag_path(out_tag, layout.DONE_MARKER)
    )
    if out_is_checkpoint and not options["overwrite"]:
        raise CheckpointError(
            f"output {output_dir} already holds a checkpoint; choose a new tag or pass --overwrite to replace it"
        )
    files = in_storage.walk_files(in_tag)
    if not files:
        raise FormatError(f"input {input_dir} does not exist or is empty")
    with tempfile.TemporaryDirectory(prefix="nxd_ckpt_convert_") as scratch:
        local_in, local_out = os.path.join(scratch, "in", in_tag), os.path.join(scratch, "out", out_tag)
        for path in files:
            target = os.path.join(scratch, "in", *path.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with in_storage.open_read(path) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        report = convert_zero1(local_in, local_out, **{**options, "overwrite": True})
        if out_is_checkpoint:  # replace: 'done' first, so a crash never leaves a complete-looking mixture
            out_storage.delete(layout.tag_path(out_tag, layout.DONE_MARKER))
            out_storage.delete_tree(out_tag)
        out_files = LocalStorage(os.path.join(scratch, "out")).walk_files(out_tag)
        done_path = layout.tag_path(out_tag, layout.DONE_MARKER)
        for path in [p for p in out_files if p != done_path] + [done_path]:
            out_storage.write_from_local_file(path, os.path.join(scratch, "out", *path.split("/")))
    report.input_dir, report.output_dir = input_dir, output_dir
    return report


def _split_tag_dir(path: str | os.PathLike[str], role: str) -> tuple[str, str]:
    full = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    root, tag = os.path.dirname(full), os.path.basename(full)
    try:
        layout.validate_tag(tag)
    except CheckpointError as e:
        raise ValueError(f"{role} directory {full} must be a tag directory with a plain name: {e}") from e
    return root, tag


def _inspect_input(storage: LocalStorage, tag: str, *, trusted: bool) -> _InputLayout:
    """The input's layout (``format.describe``, as the loader sees it), its optimizer files all checked."""
    tag_dir = f"{storage.root}/{tag}"
    if not os.path.isdir(tag_dir):
        raise FormatError(f"input directory {tag_dir} does not exist")
    names = storage.list_dir(layout.tag_path(tag, layout.OPTIM_DIR))
    shards = [c for n in names if (c := layout.parse_state_file_name(n))]
    fulls = [c for n in names if (c := layout.parse_full_optim_file_name(n))]
    if shards and fulls:
        raise FormatError(f"{tag_dir}/optim holds both dp_rank_* shards and full_* files; keep one kind")
    if not shards and not fulls and storage.exists(layout.tag_path(tag, layout.OPTIM_DIR, layout.DCP_METADATA_FILE)):
        raise FormatError(
            f"{tag_dir}/optim holds ZeRO-1 state in torch Distributed Checkpoint format (NxD's use_zero1_dcp=True), "
            "which convert-zero1 does not read; write it as NxD's per-rank ZeRO-1 files with `nxd-ckpt reshard DIR "
            "--tag TAG --dp K --param-order FILE --out OUT`"
        )
    if not shards and not fulls:
        inner = [t.name for t in tags.list_tags(LocalStorage(tag_dir), include_incomplete=True)]
        hint = (
            f"; it holds the tags {', '.join(inner)}: pass one of those tag folders (or the directory with --tag)"
            if inner
            else ""
        )
        raise FormatError(
            f"{tag_dir} is not a ZeRO-1 checkpoint: {tag_dir}/optim has no dp_rank_*/full_* optimizer files{hint}"
        )
    desc = describe(storage, tag)
    meta = desc.metadata
    if meta is not None and not meta.zero1:
        raise FormatError(f"{tag_dir} was saved with a replicated optimizer (nxd_ckpt.json says zero1=false)")
    if desc.tp is None or desc.pp is None:
        raise FormatError(f"{tag_dir} has no state files to tell its TP and PP sizes")
    if desc.ep > 1:
        raise FormatError(
            f"{tag_dir} was saved with expert parallelism: its expert parameters' ZeRO-1 state is sharded over "
            "expert-data-parallel groups, not over DP, and converting it is not supported (NxD's converter does not "
            "handle it either); resume it with the same parallel sizes"
        )
    src_dp: int | None = None
    if not desc.zero1_full:
        # NxD-written DP=1 shards look replicated by their names alone; the shard files are checked below
        src_dp = max(desc.zero1_dp_size or 1, max(c[0] for c in shards) + 1 if shards else 1)
    expected = [p for pp_ in range(desc.pp) for tp_ in range(desc.tp) for p in source_paths(tag, tp_, pp_, src_dp)]
    check_present(storage, expected)
    first = ShardFile(storage, expected[0], trusted=trusted)  # raises if it is not a ZeRO-1 state
    return _InputLayout(src_dp, desc.tp, desc.pp, first.is_xser or desc.xser, desc)


def _metadata(tag: str, info: _InputLayout, dst_dp: int | None) -> TagMetadata:
    """The output's nxd_ckpt.json: the input's (a fresh one for NxD-written input) with the new ZeRO-1 layout."""
    desc = info.description
    fresh = TagMetadata(tag=tag, created_at=None, xser=info.xser, items=desc.present_items)
    return offline_tag.output_metadata(
        desc.metadata or fresh,
        tag,
        tp=info.tp,
        pp=info.pp,
        **offline_tag.zero1_layout(dst_dp),
        converted_from={"tag": desc.tag if desc.metadata is None else desc.metadata.tag, "zero1_dp_size": info.src_dp},
        manifest_ranks=1,
    )


# --------------------------------------------------------------------------------------------- one coordinate


def _convert_coordinate(
    in_storage: LocalStorage,
    in_tag: str,
    out_storage: LocalStorage,
    out_tag: str,
    coord: tuple[int, int],
    src_dp: int | None,
    dst_dp: int | None,
    use_xser: bool,
    trusted: bool,
    bar: _Progress,
) -> tuple[list[str], int]:
    """Convert the optimizer files of one (TP, PP) coordinate, one parameter slot at a time."""
    tp, pp = coord
    sources = [ShardFile(in_storage, p, trusted=trusted) for p in source_paths(in_tag, tp, pp, src_dp)]
    n_src = len(sources)
    for s in sources:
        s.check(n_src)
        sources[0].check_same_layout(s)
    n_dst = 1 if dst_dp is None else dst_dp
    first = sources[0]
    small = first.small_state()
    slots = {
        path: (first.meta(path)[0], zero1.shard_shape(first.shapes[index], n_dst))
        for path, index in first.shard_paths.items()
    }
    out_paths = source_paths(out_tag, tp, pp, dst_dp)
    nbytes = 0
    with shard_writers(out_storage, out_paths, small, slots, use_xser=use_xser) as writers:
        for path, index in first.shard_paths.items():
            rows = first.shapes[index][0]
            src_tensors: dict[int, torch.Tensor] = {}
            for rank, w in enumerate(writers):
                nbytes += w.fill(path, functools.partial(fill_slot, path, rows, sources, src_tensors, n_dst, rank))
            release_all(sources, src_tensors)
            bar.update(1, f"tp{tp:02d}/pp{pp:02d}")
    return out_paths, nbytes


# --------------------------------------------------------------------------------------------- progress


class _Progress:
    """Thread-safe progress: a tqdm bar when stderr is a terminal, else a DEBUG log line every ~10%."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total, self.done, self._lock = total, 0, threading.Lock()
        self._next_log = 0.1
        self._bar = None
        self._enabled = enabled is not False
        if self._enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="slot", desc="convert-zero1", file=sys.stderr)
            except ImportError:
                self._bar = None

    def update(self, n: int, where: str) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
            elif self._enabled and self.total and self.done / self.total >= self._next_log:
                logger.debug("convert-zero1: %d/%d parameter slots (%s)", self.done, self.total, where)
                while self._next_log <= self.done / self.total:
                    self._next_log += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
