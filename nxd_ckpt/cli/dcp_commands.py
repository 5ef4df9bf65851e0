"""``list``, ``inspect``, ``verify`` and ``prune`` on a directory of DCP checkpoints in TorchTitan's layout
(``step-N`` folders holding ``.metadata``; ``format.dcp_folders``). The tag commands hand over here when the
directory holds such folders and no tags of the library's own format."""

from __future__ import annotations

import argparse
import datetime

from nxd_ckpt.cli.output import EXIT_FAILED, EXIT_OK, print_err, print_json, print_table
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import dcp_folders, layout
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import Storage

contents = lazy_module("nxd_ckpt.dcp.contents")  # imports torch: only inspect and verify need it


def _row(storage: Storage, folder: dcp_folders.DcpFolder, latest: str | None) -> dict:
    meta = f"{folder.name}/{layout.DCP_METADATA_FILE}"
    created = storage.mtime(meta) if folder.complete else None
    return {
        "tag": folder.name,
        "format": "dcp",
        "complete": folder.complete,
        "latest": folder.name == latest,
        "checksums": folder.manifests > 0,
        "size": sum(storage.size(p) for p in storage.walk_files(folder.name)),
        "created": datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        if created is not None
        else "",
    }


def dcp_list(args: argparse.Namespace, storage: Storage) -> int:
    """``list``: every DCP checkpoint folder, oldest first (TorchTitan's order: by step)."""
    folders = dcp_folders.list_folders(storage)
    latest = dcp_folders.latest(folders)
    entries = [_row(storage, f, latest) for f in folders]
    if args.json:
        print_json({"checkpoint_dir": storage.url, "format": "dcp", "latest": latest, "tags": entries})
        return EXIT_OK
    rows = [["FOLDER", "STATUS", "SIZE", "CHECKSUMS", "CREATED (UTC)"]]
    for e in entries:
        status = ("complete" if e["complete"] else "incomplete") + (", latest" if e["latest"] else "")
        checksums = "nxd_ckpt manifests" if e["checksums"] else "none (stock DCP)"
        rows.append([e["tag"], status, format_bytes(e["size"]), checksums, e["created"]])
    print_table(rows)
    return EXIT_OK


def _chosen(args: argparse.Namespace, storage: Storage) -> list[str]:
    """The folders ``--tag`` / ``--all`` name (default: the newest complete one)."""
    folders = dcp_folders.list_folders(storage)
    if getattr(args, "all", False):
        return [f.name for f in folders if f.complete]
    if args.tag is not None:
        if args.tag not in {f.name for f in folders}:
            names = ", ".join(f.name for f in folders) or "none"
            raise CheckpointError(f"{storage.url} has no DCP checkpoint folder {args.tag!r}; folders: {names}")
        return [args.tag]
    latest = dcp_folders.latest(folders)
    if latest is None:
        raise CheckpointError(f"no complete DCP checkpoint in {storage.url} (no folder holds .metadata)")
    return [latest]


def dcp_verify(args: argparse.Namespace, storage: Storage) -> int:
    """``verify``: each chosen folder against its manifests, or its sizes for stock DCP; exit 1 on any problem."""
    reports = [contents.verify(f"{storage.url}/{name}", allow_pickle=False) for name in _chosen(args, storage)]
    for report in reports:
        for problem in report.problems:
            print_err(f"problem: {problem}")
        for note in report.notes:
            print_err(f"note: {note}")
        if not args.json:
            status = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
            how = f"checksums from {report.manifests} manifests" if report.manifests else "sizes only, no checksums"
            print(f"{report.tag}: {status}: {report.files_checked} files checked by {how}")
    ok = all(r.ok for r in reports)
    if args.json:
        tags = [
            {"tag": r.tag, "ok": r.ok, "files_checked": r.files_checked, "bytes_checked": r.bytes_checked,
             "manifests": r.manifests, "problems": r.problems, "notes": r.notes}
            for r in reports
        ]  # fmt: skip
        print_json({"checkpoint_dir": storage.url, "format": "dcp", "ok": ok, "tags": tags})
    return EXIT_OK if ok else EXIT_FAILED


def dcp_inspect(args: argparse.Namespace, storage: Storage) -> int:
    """``inspect``: the entries of one folder's ``.metadata`` and its files."""
    name = _chosen(args, storage)[0]
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
