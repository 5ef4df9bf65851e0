"""``list``, ``inspect``, ``verify`` and ``prune`` on a directory of checkpoints in TorchTitan's layout (``step-N``
folders holding DCP's ``.metadata``, or a Hugging Face safetensors set; ``format.dcp_folders``), or on one such
folder named itself (``locate.Target``). The tag commands hand over here when the directory holds such folders and
no tags of the library's own format; a Hugging Face folder's checks are ``hf_commands``'."""

from __future__ import annotations

import argparse
import datetime
from typing import TYPE_CHECKING

from nxd_ckpt.cli import hf_commands
from nxd_ckpt.cli.output import EXIT_FAILED, EXIT_OK, print_err, print_json, print_table
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import dcp_folders
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import Storage

if TYPE_CHECKING:
    from nxd_ckpt.tools.verification import VerifyReport

contents = lazy_module("nxd_ckpt.dcp.contents")  # imports torch: only inspect and verify need it


Folder = dcp_folders.DcpFolder


def _row(storage: Storage, folder: Folder, latest: str | None) -> dict:
    created = storage.mtime(f"{folder.name}/{folder.marker}") if folder.complete else None
    return {
        "tag": folder.name,
        "format": folder.kind,
        "complete": folder.complete,
        "latest": folder.name == latest,
        "checksums": folder.manifests > 0,
        "size": sum(storage.size(p) for p in storage.walk_files(folder.name)),
        "created": datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        if created is not None
        else "",
    }


def dcp_list(args: argparse.Namespace, storage: Storage, only: Folder | None = None) -> int:
    """``list``: every checkpoint folder, oldest first (TorchTitan's order: by step); ``only`` that one."""
    folders = [only] if only is not None else dcp_folders.list_folders(storage)
    latest = dcp_folders.latest(folders)
    entries = [_row(storage, f, latest) for f in folders]
    if args.json:
        print_json({"checkpoint_dir": storage.url, "format": "dcp", "latest": latest, "tags": entries})
        return EXIT_OK
    rows = [["FOLDER", "FORMAT", "STATUS", "SIZE", "CHECKSUMS", "CREATED (UTC)"]]
    for e in entries:
        status = ("complete" if e["complete"] else "incomplete") + (", latest" if e["latest"] else "")
        checksums = "nxd_ckpt manifests" if e["checksums"] else f"none ({_UNCHECKED[e['format']]})"
        rows.append([e["tag"], e["format"], status, format_bytes(e["size"]), checksums, e["created"]])
    print_table(rows)
    return EXIT_OK


_UNCHECKED = {dcp_folders.DCP: "stock DCP", dcp_folders.HF: "safetensors, no checksums"}
"""What ``list`` says of a folder without the library's manifests, by kind."""


def _chosen(args: argparse.Namespace, storage: Storage, only: Folder | None) -> list[Folder]:
    """The folders ``--tag`` / ``--all`` name (default: the newest complete one); ``only`` the folder DIR named."""
    if only is not None:
        return [only]
    folders = dcp_folders.list_folders(storage)
    if getattr(args, "all", False):
        return [f for f in folders if f.complete]
    if args.tag is not None:
        named = [f for f in folders if f.name == args.tag]
        if not named:
            names = ", ".join(f.name for f in folders) or "none"
            raise CheckpointError(f"{storage.url} has no checkpoint folder {args.tag!r}; folders: {names}")
        return named
    latest = dcp_folders.latest(folders)
    if latest is None:
        raise CheckpointError(
            f"no complete checkpoint in {storage.url} (no folder holds DCP's .metadata or a safetensors index)"
        )
    return [f for f in folders if f.name == latest]


def _verify_folder(storage: Storage, folder: Folder) -> tuple[VerifyReport, str]:
    """One folder's report, and what was checked, in words."""
    if folder.kind == dcp_folders.HF:
        return hf_commands.verify_folder(storage, folder)
    report = contents.verify(f"{storage.url}/{folder.name}", allow_pickle=False)
    how = f"checksums from {report.manifests} manifests" if report.manifests else "sizes only, no checksums"
    return report, how


def dcp_verify(args: argparse.Namespace, storage: Storage, only: Folder | None = None) -> int:
    """``verify``: each chosen folder against its manifests, else what its format allows (stock DCP: sizes; HF:
    headers and byte ranges); exit 1 on any problem."""
    checked = [_verify_folder(storage, f) for f in _chosen(args, storage, only)]
    for report, how in checked:
        for problem in report.problems:
            print_err(f"problem: {problem}")
        for note in report.notes:
            print_err(f"note: {note}")
        if not args.json:
            status = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
            print(f"{report.tag}: {status}: {report.files_checked} files checked by {how}")
    ok = all(r.ok for r, _ in checked)
    if args.json:
        tags = [
            {"tag": r.tag, "ok": r.ok, "checked": how, "files_checked": r.files_checked,
             "bytes_checked": r.bytes_checked, "manifests": r.manifests, "problems": r.problems, "notes": r.notes}
            for r, how in checked
        ]  # fmt: skip
        formats = sorted({f.kind for f in _chosen(args, storage, only)})
        print_json({"checkpoint_dir": storage.url, "format": "/".join(formats), "ok": ok, "tags": tags})
    return EXIT_OK if ok else EXIT_FAILED


def dcp_inspect(args: argparse.Namespace, storage: Storage, only: Folder | None = None) -> int:
    """``inspect``: the entries of one folder's ``.metadata`` and its files (an HF folder: its tensors)."""
    folder = _chosen(args, storage, only)[0]
    if folder.kind == dcp_folders.HF:
        return hf_commands.hf_inspect(args, storage, folder)
    name = folder.name
    desc = contents.describe(f"{storage.url}/{name}", allow_pickle=getattr(args, "allow_pickle", False))
    if args.json:
        print_json(desc.to_json())
        return EXIT_OK
    checksums = f"{desc.manifests} nxd_ckpt manifests" if desc.manifests else "no checksums (stock DCP)"
    print(f"{desc.path}: DCP checkpoint, {len(desc.entries)} entries, {checksums}")
    print("files:")
    print_table([[f"  {path}", format_bytes(size)] for path, size in desc.files])
    print("entries:")
    rows = [
        [f"  {e.fqn}", e.kind, e.dtype or "", "x".join(map(str, e.shape or ())), f"{e.chunks} chunks" if e.chunks
         else "", format_bytes(e.nbytes)]
        for e in desc.entries
    ]  # fmt: skip
    print_table(rows)
    return EXIT_OK


def dcp_prune(args: argparse.Namespace, storage: Storage) -> int:
    """``prune``: delete all but the newest ``--keep`` complete folders (``.metadata`` first); ``--dry-run``."""
    doomed = dcp_folders.to_prune(dcp_folders.list_folders(storage), args.keep)
    if not doomed:
        print(f"nothing to delete: at most {args.keep} complete checkpoints in {storage.url}")
        return EXIT_OK
    for name in doomed:
        if args.dry_run:
            print(f"would delete {name}")
            continue
        dcp_folders.delete_folder(storage, name)
        print(f"deleted {name}")
    return EXIT_OK
