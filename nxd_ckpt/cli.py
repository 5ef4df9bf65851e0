"""``nxd-ckpt``: look into, check, prune and export checkpoints from the shell.

Exit status: 0 on success, 1 when the operation failed (or ``verify`` found a problem), 2 for usage errors.
Results go to stdout, diagnostics to stderr; progress bars appear only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from nxd_ckpt import __version__
from nxd_ckpt.errors import CheckpointError, UnsafeCheckpointError
from nxd_ckpt.format import layout, retention, tags
from nxd_ckpt.inspect import Checkpoint, open_checkpoint
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.storage import DelegatingStorage, Storage, storage_for
from nxd_ckpt.tools import zero1_cli

# Imported on first use: `list`, `--help` and usage errors never import torch (2-3 s); see tests/cli.
completeness = lazy_module("nxd_ckpt.tools.completeness")
verification = lazy_module("nxd_ckpt.tools.verification")
export = lazy_module("nxd_ckpt.tools.export")
model_source = lazy_module("nxd_ckpt.tools.model_source")
safetensors_io = lazy_module("nxd_ckpt.tools.safetensors_io")
model_writer = lazy_module("nxd_ckpt.tools.model_writer")
reshard = lazy_module("nxd_ckpt.tools.reshard")
importer = lazy_module("nxd_ckpt.tools.importer")
tool_memory = lazy_module("nxd_ckpt.tools.memory")

PROG = "nxd-ckpt"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ---------------------------------------------------------------------------------------------- output


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def _err(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr when it is a terminal (and not disabled), else an object that ignores updates."""
    if not enabled or not sys.stderr.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)


class _CountingStream:
    """A read stream that reports the bytes read through it."""

    def __init__(self, f: Any, report: Callable[[int], Any]) -> None:
        self._f, self._report = f, report

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._report(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._report(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class ReadProgressStorage(DelegatingStorage):
    """Delegates to another storage and reports every byte read (drives the progress bar of ``verify``)."""

    def __init__(self, inner: Storage, report: Callable[[int], Any]) -> None:
        super().__init__(inner)
        self._report = report

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self.inner.open_read(path) as f:
            yield _CountingStream(f, self._report)  # type: ignore[misc]

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        self._report(len(data))
        return data

    read_buffer = Storage.read_buffer  # through open_read above, so whole-file reads are counted too

    def local_path(self, path: str) -> str | None:
        return None  # every read goes through this wrapper, to be counted


# ---------------------------------------------------------------------------------------------- helpers


def _storage(directory: str, command: str) -> Storage:
    storage = storage_for(directory)
    if "://" not in directory and not os.path.exists(directory):
        raise CheckpointError(f"{directory}: no such directory")
    if "://" not in directory and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
    if storage.exists(layout.DONE_MARKER) or storage.exists(layout.CHECKPOINT_MARKER):
        path = os.path.normpath(directory)
        parent, tag = os.path.dirname(path) or ".", os.path.basename(path)
        # `list` and `prune` work on the whole directory; the others take --tag.
        fix = f"{PROG} {command} {parent}" + ("" if command in ("list", "prune") else f" --tag {tag}")
        raise CheckpointError(
            f"{directory} is one checkpoint (a tag directory); pass the directory holding the tags instead: {fix}"
        )
    return storage


def _tag_size(storage: Storage, tag: str) -> int:
    return sum(storage.size(p) for p in storage.walk_files(tag))


def _created(info: tags.TagInfo) -> str:
    return datetime.datetime.fromtimestamp(info.order_time, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _open(args: argparse.Namespace) -> Checkpoint:
    storage = _storage(args.dir, args.command)
    return open_checkpoint(
        storage, args.tag, allow_incomplete=args.tag is not None, allow_pickle=getattr(args, "allow_pickle", False)
    )


# ---------------------------------------------------------------------------------------------- commands


def cmd_list(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args.command)
    infos = tags.list_tags(storage, include_incomplete=True)
    latest = tags.latest_tag(storage)
    entries = []
    for info in infos:
        lay = Checkpoint(storage, info.name).layout()
        entries.append(
            {
                "tag": info.name,
                "complete": info.complete,
                "latest": info.name == latest,
                "size": _tag_size(storage, info.name),
                "created": _created(info),
                "layout": lay.to_json(),
                "layout_text": lay.describe(),
            }
        )
    if args.json:
        _print_json({"checkpoint_dir": storage.url, "latest": latest, "tags": entries})
        return EXIT_OK
    if not entries:
        _err(f"no checkpoints in {storage.url}")
        return EXIT_OK
    rows = [["TAG", "STATUS", "SIZE", "LAYOUT", "CREATED (UTC)"]]
    for e in entries:
        status = ("complete" if e["complete"] else "incomplete") + (", latest" if e["latest"] else "")
        rows.append([e["tag"], status, human_bytes(e["size"]), e["layout_text"], e["created"]])
    _print_table(rows)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect``: one object (``--object``), the tag's metadata (``--metadata``), or every state file's contents;
    exit status 1 if a state file is damaged."""
    ckpt = _open(args)
    if args.object:
        return _show_object(ckpt, args.object, args.json)
    lay = ckpt.layout()
    files = ckpt.files()
    if args.metadata:
        return _show_metadata(ckpt, lay, files, args)
    state, damaged = _state_file_summaries(ckpt)
    totals = _inspect_totals(files, state)
    if args.json:
        _print_json({**_tag_summary(ckpt, lay, files), "state_files": state, "totals": totals})
        return EXIT_FAILED if damaged else EXIT_OK
    _print_tag_header(ckpt, lay)
    print("files:")
    _print_table([[f"  {name}", human_bytes(size)] for name, size in _file_rows(files, args.files)])
    for summary in state:
        _print_state_file(ckpt, summary)
    print(
        f"\ntotal: {totals['state_files']} state files, {totals['tensors']} tensors, "
        f"{human_bytes(totals['tensor_bytes'])} of tensor data; {totals['files']} files, "
        f"{human_bytes(totals['file_bytes'])} on disk"
    )
    return EXIT_FAILED if damaged else EXIT_OK


def _state_file_summaries(ckpt: Checkpoint) -> tuple[list[dict[str, Any]], bool]:
    """One summary per state file (its objects, or the error reading it, also printed on stderr), and whether one
    is damaged (a file refused for safety is not: the rest is still shown)."""
    state = []
    damaged = False
    for sf in ckpt.state_files():
        error = None
        try:
            objects = ckpt.objects(sf)
        except UnsafeCheckpointError as e:  # refused for safety, not damaged: show the rest
            objects, error = [], str(e)
        except CheckpointError as e:
            objects, error, damaged = [], str(e), True
        tensors = [o for o in objects if o.kind == "tensor"]
        state.append(
            {
                "path": sf.path,
                "prefix": sf.prefix,
                "encoding": sf.encoding,
                "tensors": len(tensors),
                "tensor_bytes": sum(o.nbytes for o in tensors),
                "objects": [o.to_json() for o in objects],
                "error": error,
            }
        )
        if error is not None:
            _err(error)
    return state, damaged


def _inspect_totals(files: list[tuple[str, int]], state: list[dict[str, Any]]) -> dict[str, int]:
    """The last line of ``inspect``: files and bytes on storage, state files, tensors and their bytes."""
    return {
        "files": len(files),
        "file_bytes": sum(size for _, size in files),
        "state_files": len(state),
        "tensors": sum(s["tensors"] for s in state),
        "tensor_bytes": sum(s["tensor_bytes"] for s in state),
    }


def _tag_summary(ckpt: Checkpoint, lay: Any, files: list[tuple[str, int]]) -> dict[str, Any]:
    """What ``inspect --json`` shows of every tag, with or without ``--metadata``."""
    return {
        "checkpoint_dir": ckpt.storage.url,
        "tag": ckpt.tag,
        "complete": ckpt.complete,
        "layout": lay.to_json(),
        "metadata": ckpt.metadata,
        "files": [{"path": p, "size": s} for p, s in files],
    }


def _print_tag_header(ckpt: Checkpoint, lay: Any) -> None:
    """The first two lines of ``inspect``: the tag, whether it is complete, its layout."""
    print(f"checkpoint {ckpt.url} ({'complete' if ckpt.complete else 'INCOMPLETE: no done marker'})")
    print(f"layout: {lay.describe()}")


def _print_state_file(ckpt: Checkpoint, summary: dict[str, Any]) -> None:
    """One state file of ``inspect``: a title line, then one row per object (a tensor's dtype, shape and bytes)."""
    rel = summary["path"][len(ckpt.tag) + 1 :]
    print(
        f"\n{rel}  [{summary['prefix']}]  {summary['encoding']}, {summary['tensors']} tensors, "
        f"{human_bytes(summary['tensor_bytes'])}"
    )
    if summary["error"] is not None:
        print("  (not readable, see the message on stderr)")
    rows = []
    for o in summary["objects"]:
        name = o["path"][len(summary["prefix"]) + 1 :]
        if o["kind"] == "tensor":
            rows.append([f"  {name}", o["dtype"], str(o["shape"]), human_bytes(o["nbytes"])])
        else:
            rows.append([f"  {name}", o["dtype"], "=", _short(o["value"])])
    if rows:
        _print_table(rows)


def _show_metadata(ckpt: Checkpoint, lay: Any, files: list[tuple[str, int]], args: argparse.Namespace) -> int:
    """``inspect --metadata``: layout, nxd_ckpt.json and files, without opening a state file (nor torch)."""
    if args.json:
        _print_json(_tag_summary(ckpt, lay, files))
        return EXIT_OK
    _print_tag_header(ckpt, lay)
    meta = ckpt.metadata
    print("metadata (nxd_ckpt.json):" if meta else "metadata: none (a tag written by NxD, or an unfinished save)")
    for key, value in (meta or {}).items():
        print(f"  {key}: {json.dumps(value, default=str)}")
    print("files:")
    _print_table([[f"  {name}", human_bytes(size)] for name, size in _file_rows(files, args.files)])
    return EXIT_OK


def _file_rows(files: list[tuple[str, int]], every: bool) -> list[tuple[str, int]]:
    """Files with sizes; unless ``every``, each xser ``.tensors/`` directory is one row (file count, total)."""
    if every:
        return files
    rows: list[tuple[str, int]] = []
    dirs: dict[str, list[int]] = {}
    for path, size in files:
        directory, _, _ = path.rpartition("/")
        if directory.endswith(layout.XSER_TENSORS_SUFFIX):
            if directory not in dirs:
                dirs[directory] = [0, 0]
                rows.append((directory, -1))
            dirs[directory][0] += 1
            dirs[directory][1] += size
        else:
            rows.append((path, size))
    return [(f"{p}/ ({dirs[p][0]} files)", dirs[p][1]) if size < 0 else (p, size) for p, size in rows]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_json(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return {"dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape), "values": obj.tolist()}
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else repr(obj)


def _show_object(ckpt: Checkpoint, path: str, as_json: bool) -> int:
    import torch

    obj = ckpt.read(path)
    if as_json:
        _print_json({"tag": ckpt.tag, "path": path, "object": _to_json(obj)})
    elif isinstance(obj, torch.Tensor):
        print(f"{path}: {str(obj.dtype).removeprefix('torch.')} {list(obj.shape)}")
        print(obj)
    else:
        print(f"{path}:")
        print(obj)
    return EXIT_OK


def _verify_one(ckpt: Checkpoint, quick: bool, progress: bool) -> dict[str, Any]:
    """``verification.verify`` (the same checks and verdict as ``nxd_ckpt.verify``), or with ``quick`` only the
    structure checks that read no data (``completeness.check_structure``)."""
    url = ckpt.storage.url
    result: dict[str, Any] = {"tag": ckpt.tag, "files_checked": 0, "bytes_checked": 0, "manifests": 0, "notes": []}
    if quick:
        problems = [f"{url}/{p.path}: {p.message}" for p in completeness.check_structure(ckpt)]
    else:
        total = sum(size for _, size in ckpt.files())
        bar = progress_bar(total, f"verify {ckpt.tag}", progress)
        try:
            report = verification.verify(ReadProgressStorage(ckpt.storage, bar.update), ckpt.tag)
        finally:
            bar.close()
        problems = list(report.problems)
        result.update(
            files_checked=report.files_checked,
            bytes_checked=report.bytes_checked,
            manifests=report.manifests,
            notes=list(report.notes),
        )
    result.update(ok=not problems, problems=problems)
    return result


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args.command)
    if args.all:
        names = [t.name for t in tags.list_tags(storage)]
        if not names:
            raise CheckpointError(f"no complete checkpoint in {storage.url}")
        checkpoints = [Checkpoint(storage, n) for n in names]
    else:
        checkpoints = [_open(args)]
    results = []
    for ckpt in checkpoints:
        result = _verify_one(ckpt, args.quick, args.progress)
        results.append(result)
        for problem in result["problems"]:
            _err(f"problem: {problem}")
        if args.verbose:
            for note in result["notes"]:
                _err(f"note: {note}")
        if not args.json:
            n = len(result["problems"])
            status = "OK" if result["ok"] else f"FAILED ({n} problem{'s' if n > 1 else ''})"
            if args.quick:
                detail = "structure only (no data read)"
            else:
                n_manifests = result["manifests"]
                how = (
                    f"checksums from {n_manifests} manifest{'s' if n_manifests > 1 else ''}"
                    if n_manifests
                    else "zip CRCs"
                )
                detail = f"{result['files_checked']} files, {human_bytes(result['bytes_checked'])} checked by {how}"
            print(f"{ckpt.tag}: {status}: {detail}")
    ok = all(r["ok"] for r in results)
    if args.json:
        _print_json({"checkpoint_dir": storage.url, "ok": ok, "tags": results})
    return EXIT_OK if ok else EXIT_FAILED


def cmd_prune(args: argparse.Namespace) -> int:
    storage = _storage(args.dir, args.command)
    doomed = retention.KeepLatest(args.keep).to_delete(tags.list_tags(storage, include_incomplete=True))
    if args.dry_run:
        for name in doomed:
            print(f"would delete {name}")
        if not doomed:
            print(f"nothing to delete: at most {args.keep} complete checkpoints in {storage.url}")
        return EXIT_OK
    deleted = retention.delete_tags(storage, doomed)
    for name in deleted:
        print(f"deleted {name}")
    if not doomed:
        print(f"nothing to delete: at most {args.keep} complete checkpoints in {storage.url}")
    failed = [n for n in doomed if n not in deleted]
    for name in failed:
        _err(f"could not delete {storage.url}/{name} (see the warning above)")
    return EXIT_FAILED if failed else EXIT_OK


def _rename_map(args: argparse.Namespace) -> Any:
    rename = export.RenameMap()
    if getattr(args, "rename", None):
        rename = rename.then(export.RenameMap.from_file(args.rename))
    if getattr(args, "rename_pattern", None):
        rename = rename.then(export.RenameMap.from_pairs(args.rename_pattern))
    return rename


def _sharding_spec(args: argparse.Namespace) -> Any:
    return model_source.read_sharding_spec(args.sharding_spec) if getattr(args, "sharding_spec", None) else None


def cmd_export(args: argparse.Namespace) -> int:
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/memory.py
    if os.path.lexists(args.out) and not args.force:
        raise CheckpointError(f"{args.out} already exists; pass --force to overwrite it")
    if args.shard and (args.format != "safetensors" or not args.out.endswith(".safetensors")):
        raise ValueError("--shard writes one state file as one .safetensors file: give --out FILE.safetensors")
    rename, spec = _rename_map(args), _sharding_spec(args)
    max_shard = safetensors_io.parse_size(args.max_shard_size)
    ckpt = _open(args)
    total = sum(o.nbytes for o in ckpt.objects() if o.kind == "tensor" and o.path.startswith("model/"))
    bar = progress_bar(total, f"export {ckpt.tag}", args.progress)
    try:
        if args.shard:
            report = export.export_state_file(ckpt, args.shard, args.out, progress=bar.update)
        else:
            report = export.export(
                ckpt,
                args.out,
                format=args.format,
                sharding=spec,
                rename=rename,
                max_shard_bytes=max_shard,
                overwrite=args.force,
                progress=bar.update,
            )
    finally:
        bar.close()
    if report.skipped:
        _err(
            f"skipped {len(report.skipped)} values ({report.format} export holds tensors only; an optimum-neuron "
            "tag's consolidation keeps its parameters only): "
            + ", ".join(report.skipped[:5])
            + (" ..." if len(report.skipped) > 5 else "")
        )
    files = f" in {len(report.files)} files" if len(report.files) > 1 else ""
    print(f"wrote {report.out}: {report.tensors} tensors, {human_bytes(report.nbytes)}{files} from {ckpt.url}")
    return EXIT_OK


def _stage_map(args: argparse.Namespace) -> Any:
    if not getattr(args, "stage_map", None):
        return None
    try:
        with open(args.stage_map) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"stage map {args.stage_map} could not be read as JSON: {e}") from e
    if not isinstance(doc, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in doc.values()):
        raise ValueError(
            f'stage map {args.stage_map} must be a JSON object of name pattern -> PP stage, e.g. {{"*": 0}}'
        )
    return model_writer.stage_map(doc)


def _param_order(args: argparse.Namespace) -> Any:
    if not getattr(args, "param_order", None):
        return None
    try:
        with open(args.param_order) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"parameter order {args.param_order} could not be read as JSON: {e}") from e
    if not isinstance(doc, dict) or not all(
        isinstance(v, list) and all(isinstance(n, str) for n in v) for v in doc.values()
    ):
        raise ValueError(f'parameter order {args.param_order} must be JSON {{"PP stage": [names], ...}}')
    try:
        return {int(k): v for k, v in doc.items()}
    except ValueError as e:
        raise ValueError(f"parameter order {args.param_order}: keys must be PP stage numbers ({e})") from e


def cmd_reshard(args: argparse.Namespace) -> int:
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/memory.py
    if args.tp is None and args.pp is None and args.dp is None:
        raise ValueError("give the target layout: --tp, --pp and/or --dp")
    spec, stage_of = _sharding_spec(args), _stage_map(args)
    ckpt = _open(args)
    bar = progress_bar(0, f"reshard {ckpt.tag}", args.progress)
    try:
        report = reshard.reshard(
            ckpt,
            args.out,
            args.out_tag,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            sharding=spec,
            stage_of=stage_of,
            model_only=args.model_only,
            num_workers=args.num_workers,
            param_order=_param_order(args),
            progress=bar.update,
        )
    finally:
        bar.close()
    print(report.summary())
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    tool_memory.return_large_blocks_to_the_system()  # this process is the tool: see tools/memory.py
    spec, stage_of = _sharding_spec(args), _stage_map(args)
    report = importer.import_weights(
        args.source,
        args.out,
        args.tag,
        tp=args.tp,
        pp=args.pp,
        sharding=spec,
        stage_of=stage_of,
        format=args.format,
        rename=_rename_map(args),
        use_xser=args.xser,
        allow_pickle=args.allow_pickle,
    )
    print(report.summary())
    return EXIT_OK


def cmd_convert_zero1(args: argparse.Namespace) -> int:
    """The ZeRO-1 converter (nxd_ckpt.tools.convert_zero1) with the checkpoint directory + --tag, like the others."""
    return zero1_cli.run(args, prog=f"{PROG} convert-zero1")


# ---------------------------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    """argparse type of the sizes and counts: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class Arg:
    """One command-line argument, declared once: argparse's ``add_argument(*flags, **options)``."""

    flags: tuple[str, ...]
    options: dict[str, Any]

    def add_to(self, parser: argparse.ArgumentParser, command: str = "", **overrides: Any) -> None:
        """Add it to ``parser``; ``{command}`` in the help names the subcommand."""
        options = {**self.options, **overrides}
        if isinstance(options.get("help"), str):
            options["help"] = options["help"].replace("{command}", command)
        parser.add_argument(*self.flags, **options)


def _arg(*flags: str, **options: Any) -> Arg:
    """An Arg, spelled as ``add_argument``'s call."""
    return Arg(flags, options)


_SHARDING_JSON = (
    'JSON of name pattern -> partition dim, [dim, stride] or null (replicated), e.g. {"*.qkv_proj.weight": [0, 3], '
    '"*": null}'
)

GLOBAL_ARGS = (
    _arg("-v", "--verbose", action="store_true", help="log what nxd_ckpt does (to stderr)"),
    _arg(
        "--no-progress", dest="progress", action="store_false", help="no progress bars (they only show on a terminal)"
    ),
)
"""The main parser's options; accepted after the subcommand too (hidden there, defaults stay the main parser's)."""

SHARED_ARGS = {
    "dir": _arg(
        "dir", metavar="DIR", help="checkpoint directory (the one holding the tag directories) or s3://bucket/prefix"
    ),
    "tag": _arg("--tag", help="tag to {command} (default: the latest complete one)"),
    "json": _arg("--json", action="store_true", help="machine-readable output"),
    "allow-pickle": _arg(
        "--allow-pickle", action="store_true", help="unpickle arbitrary classes (trusted checkpoints only)"
    ),
    "rename": _arg(
        "--rename", metavar="FILE", help='JSON rename map: {"old": "new"} or {"exact": {...}, "patterns": [[re, repl]]}'
    ),
    "rename-pattern": _arg(
        "--rename-pattern",
        action="append",
        metavar="REGEX=REPL",
        help="rename names matching REGEX (re.sub replacement; repeatable, first match wins)",
    ),
    "sharding-spec": _arg(
        "--sharding-spec",
        metavar="FILE",
        help="how tensors are split over TP ranks when no record says so: " + _SHARDING_JSON,
    ),
    "stage-map": _arg(
        "--stage-map",
        metavar="FILE",
        help='for a PP change: JSON of name pattern -> target PP stage, e.g. {"layers.[0-3].*": 0, "*": 1}',
    ),
}
"""The arguments several subcommands take, by name: a command lists the names it takes (``COMMANDS``)."""


def _shared(name: str, **overrides: Any) -> Arg:
    """A shared argument with this command's own wording (``help=``) or settings."""
    arg = SHARED_ARGS[name]
    return Arg(arg.flags, {**arg.options, **overrides})


CommandArg = str | Arg | Callable[[argparse.ArgumentParser], Any]
"""A name in SHARED_ARGS, an argument of one command, or a function adding a group of them (the converter's)."""


@dataclass(frozen=True)
class Command:
    """One subcommand: the function running it, its help (also its description), its arguments in --help order."""

    name: str
    run: Callable[[argparse.Namespace], int]
    help: str
    arguments: tuple[CommandArg, ...]

    def add_to(self, subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
        """Its subparser, with its arguments."""
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help, parents=parents)
        parser.set_defaults(func=self.run)
        for argument in self.arguments:
            if isinstance(argument, str):
                SHARED_ARGS[argument].add_to(parser, self.name)
            elif isinstance(argument, Arg):
                argument.add_to(parser, self.name)
            else:
                argument(parser)


COMMANDS = (
    Command(
        "list",
        cmd_list,
        "list the tags of a checkpoint directory, oldest first: complete or not, latest, size, layout",
        ("dir", "json"),
    ),
    Command(
        "inspect",
        cmd_inspect,
        "show a checkpoint's state files and, per file, every tensor's shape, dtype and bytes, without loading "
        "tensor data",
        (
            "dir",
            "tag",
            "json",
            _arg("--files", action="store_true", help="list every file (default: one line per xser .tensors dir)"),
            _arg("--object", metavar="PATH", help="print one object, e.g. model/tp00_pp00/fc1.weight"),
            _arg(
                "--metadata",
                action="store_true",
                help="layout, nxd_ckpt.json and files only (no state file is opened)",
            ),
            "allow-pickle",
        ),
    ),
    Command(
        "verify",
        cmd_verify,
        "check a checkpoint: done marker, every state file the layout needs, readable files, CRC-32s and recorded "
        "checksums; exit status 1 if anything is wrong",
        (
            "dir",
            "tag",
            _arg("--all", action="store_true", help="verify every complete tag"),
            _arg("--quick", action="store_true", help="check structure only, without reading tensor data"),
            "json",
        ),
    ),
    Command(
        "convert-zero1",
        cmd_convert_zero1,
        "convert a tag's ZeRO-1 optimizer state between sharded and full, or to a new DP size; writes a complete, "
        "verified tag ('done' last). NxD's flags (--input_dir TAG_FOLDER --output_dir TAG_FOLDER --convert_to_full "
        "...) are accepted too",
        (zero1_cli.add_arguments,),
    ),
    Command(
        "prune",
        cmd_prune,
        "delete all but the newest N complete checkpoints (and incomplete ones older than those), 'done' first so a "
        "crash never leaves a tag that looks complete",
        (
            "dir",
            _arg("--keep", type=_positive_int, required=True, metavar="N", help="complete checkpoints to keep"),
            _arg("--dry-run", action="store_true", help="only print what would be deleted"),
        ),
    ),
    Command(
        "export",
        cmd_export,
        "write a checkpoint's model state (any TP/PP layout: shards merged, stages joined) as one Hugging Face-style "
        "safetensors set, one .safetensors file, or a torch Distributed Checkpoint (--format dcp)",
        (
            "dir",
            "tag",
            _arg(
                "--out",
                required=True,
                metavar="PATH",
                help="directory to create (safetensors set: model-0000i-of-0000N.safetensors + "
                "model.safetensors.index.json; or a DCP checkpoint), or FILE.safetensors for one file",
            ),
            _arg("--format", choices=("safetensors", "dcp"), default="safetensors", help="default: safetensors"),
            _arg(
                "--max-shard-size",
                default="5GB",
                metavar="SIZE",
                help="largest file of a safetensors set (default 5GB)",
            ),
            "rename",
            "rename-pattern",
            _shared(
                "sharding-spec",
                help="for tags saved at TP>1 without a sharding record (NxD-written): " + _SHARDING_JSON,
            ),
            _arg("--shard", metavar="PREFIX", help="export one state file as saved instead, e.g. model/tp01_pp00"),
            _arg("--force", action="store_true", help="replace PATH if it exists (once the new one is complete)"),
            "allow-pickle",
        ),
    ),
    Command(
        "reshard",
        cmd_reshard,
        "write a tag re-sharded for another TP/PP/DP layout as a new, verified tag ('done' last). A DP-only change "
        "re-cuts ZeRO-1 optimizer shards (as convert-zero1); a TP/PP change streams the model one tensor at a time "
        "(--model-only: the optimizer state is not carried; load_checkpoint re-shards it online)",
        (
            "dir",
            "tag",
            _arg("--tp", type=_positive_int, metavar="N", help="target tensor-parallel size (default: the tag's)"),
            _arg("--pp", type=_positive_int, metavar="M", help="target pipeline-parallel size (default: the tag's)"),
            _arg("--dp", type=_positive_int, metavar="K", help="target data-parallel size (ZeRO-1 shards)"),
            _arg("--out", required=True, metavar="OUT", help="checkpoint directory to write the new tag into"),
            _arg("--out-tag", metavar="TAG", help="tag name to write (default: the input's); must not exist"),
            _arg("--model-only", action="store_true", help="TP/PP change: drop the optimizer state"),
            _arg(
                "--param-order",
                metavar="FILE",
                help='ZeRO-1 state NxD saved through DCP (use_zero1_dcp=True): JSON {"PP stage": [parameter names in '
                "the optimizer's order]}, to write it as NxD's per-rank ZeRO-1 files for --dp",
            ),
            _arg(
                "--num-workers", type=_positive_int, default=1, metavar="N", help="DP change: coordinates in parallel"
            ),
            "sharding-spec",
            "stage-map",
            "allow-pickle",
        ),
    ),
    Command(
        "import",
        cmd_import,
        "write whole-model weights (a safetensors file or set, or a DCP checkpoint) as an NxD-layout tag for a TP/PP "
        "layout (model only; loads at any DP), verified, 'done' last",
        (
            _arg("source", metavar="SOURCE", help="a .safetensors file, a safetensors set directory or a DCP dir"),
            _arg("--out", required=True, metavar="DIR", help="checkpoint directory to write the tag into"),
            _arg("--tag", required=True, help="tag name to write (must not exist)"),
            _arg("--tp", type=_positive_int, default=1, metavar="N", help="tensor-parallel size (default 1)"),
            _arg("--pp", type=_positive_int, default=1, metavar="M", help="pipeline-parallel size (default 1)"),
            _arg("--format", choices=("safetensors", "dcp"), help="default: detected from SOURCE"),
            _arg("--xser", action="store_true", help="write xser model files (one file per tensor)"),
            _shared("rename", help="JSON rename map applied to the source's names first"),
            _shared("rename-pattern", help="rename by pattern (repeatable)"),
            "sharding-spec",
            "stage-map",
            _shared("allow-pickle", help="DCP: unpickle .metadata without restrictions (trusted only)"),
        ),
    ),
)
"""Every subcommand, in --help order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``nxd-ckpt`` parser: the global options, then one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look into, check, prune and export nxd_ckpt / NeuronX Distributed checkpoints. "
        "DIR is a checkpoint directory (the one holding the tag directories) or s3://bucket/prefix.",
        epilog="Exit status: 0 success, 1 failure (or problems found), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    hidden_globals = argparse.ArgumentParser(add_help=False)
    for arg in GLOBAL_ARGS:
        arg.add_to(parser)
        arg.add_to(hidden_globals, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in COMMANDS:
        command.add_to(subparsers, parents=[hidden_globals])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format=f"{PROG}: %(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # e.g. piped into head: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return EXIT_OK
    except KeyError as e:  # an object path that is not in the checkpoint
        _err(f"error: {e.args[0] if e.args else e}")
        return EXIT_FAILED
    except (CheckpointError, OSError, ValueError) as e:
        _err(f"error: {e}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
