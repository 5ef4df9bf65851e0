"""``inspect``: a tag's files, state files and objects (shape, dtype, bytes) without loading tensor data, its
metadata alone (``--metadata``, no torch), or one object's value (``--object``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from nxd_ckpt.cli import dcp_commands
from nxd_ckpt.cli.locate import locate, open_tag
from nxd_ckpt.cli.output import EXIT_FAILED, EXIT_OK, print_err, print_json, print_table
from nxd_ckpt.errors import CheckpointError, UnsafeCheckpointError
from nxd_ckpt.format import dcp_folders, layout
from nxd_ckpt.inspection import Checkpoint
from nxd_ckpt.log import format_bytes


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect``: one object (``--object``), the tag's metadata (``--metadata``), or every state file's contents;
    exit status 1 if a state file is damaged. A DCP or HF checkpoint folder (named itself, or by ``--tag``): its
    entries or tensors."""
    target = locate(args.dir, args.command, args.tag)
    if target.folder is not None or dcp_folders.is_dcp_directory(target.storage):
        return dcp_commands.dcp_inspect(args, target.storage, target.folder)
    ckpt = open_tag(args)
    if args.object:
        return _show_object(ckpt, args.object, args.json)
    lay = ckpt.layout()
    files = ckpt.files()
    if args.metadata:
        return _show_metadata(ckpt, lay, files, args)
    state, damaged = _state_file_summaries(ckpt)
    totals = _inspect_totals(files, state)
    if args.json:
        print_json({**_tag_summary(ckpt, lay, files), "state_files": state, "totals": totals})
        return EXIT_FAILED if damaged else EXIT_OK
    _print_tag_header(ckpt, lay)
    print("files:")
    print_table([[f"  {name}", format_bytes(size)] for name, size in _file_rows(files, args.files)])
    for summary in state:
        _print_state_file(ckpt, summary)
    print(
        f"\ntotal: {totals['state_files']} state files, {totals['tensors']} tensors, "
        f"{format_bytes(totals['tensor_bytes'])} of tensor data; {totals['files']} files, "
        f"{format_bytes(totals['file_bytes'])} on disk"
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
            print_err(error)
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
        f"{format_bytes(summary['tensor_bytes'])}"
    )
    if summary["error"] is not None:
        print("  (not readable, see the message on stderr)")
    rows = []
    for o in summary["objects"]:
        name = o["path"][len(summary["prefix"]) + 1 :]
        if o["kind"] == "tensor":
            rows.append([f"  {name}", o["dtype"], str(o["shape"]), format_bytes(o["nbytes"])])
        else:
            rows.append([f"  {name}", o["dtype"], "=", _short(o["value"])])
    if rows:
        print_table(rows)


def _show_metadata(ckpt: Checkpoint, lay: Any, files: list[tuple[str, int]], args: argparse.Namespace) -> int:
    """``inspect --metadata``: layout, nxd_ckpt.json and files, without opening a state file (nor torch)."""
    if args.json:
        print_json(_tag_summary(ckpt, lay, files))
        return EXIT_OK
    _print_tag_header(ckpt, lay)
    meta = ckpt.metadata
    print("metadata (nxd_ckpt.json):" if meta else "metadata: none (a tag written by NxD, or an unfinished save)")
    for key, value in (meta or {}).items():
        print(f"  {key}: {json.dumps(value, default=str)}")
    print("files:")
    print_table([[f"  {name}", format_bytes(size)] for name, size in _file_rows(files, args.files)])
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
    """A value's repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_json(obj: Any) -> Any:
    """An object read from a checkpoint as JSON: tensors as dtype, shape and values; the rest as itself or its repr."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {"dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape), "values": obj.tolist()}
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else repr(obj)


def _show_object(ckpt: Checkpoint, path: str, as_json: bool) -> int:
    """``inspect --object``: one object's value (a tensor with its dtype and shape)."""
    import torch

    obj = ckpt.read(path)
    if as_json:
        print_json({"tag": ckpt.tag, "path": path, "object": _to_json(obj)})
    elif isinstance(obj, torch.Tensor):
        print(f"{path}: {str(obj.dtype).removeprefix('torch.')} {list(obj.shape)}")
        print(obj)
    else:
        print(f"{path}:")
        print(obj)
    return EXIT_OK
