"""The commands over a directory's tags: ``list``, ``verify`` and ``prune`` (``inspect`` has its own module)."""

from __future__ import annotations

import argparse
import datetime
from typing import Any

from nxd_ckpt.cli import dcp_commands
from nxd_ckpt.cli.locate import locate, open_tag, refuse_folder
from nxd_ckpt.cli.output import EXIT_FAILED, EXIT_OK, print_err, print_json, print_table
from nxd_ckpt.cli.progress import ReadProgressStorage, progress_bar
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import dcp_folders, retention, tags
from nxd_ckpt.inspection import Checkpoint
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import Storage

# Imported on first use: `list` never imports torch (2-3 s); see tests/cli.
completeness = lazy_module("nxd_ckpt.tools.completeness")
verification = lazy_module("nxd_ckpt.tools.verification")


def _tag_size(storage: Storage, tag: str) -> int:
    """Bytes of every file under a tag."""
    return sum(storage.size(p) for p in storage.walk_files(tag))


def _created(info: tags.TagInfo) -> str:
    """When a tag was written, as UTC date and time."""
    return datetime.datetime.fromtimestamp(info.order_time, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def cmd_list(args: argparse.Namespace) -> int:
    """``list``: every tag, oldest first, complete or not, latest, size, layout and creation time (of a DCP or HF
    checkpoint folder named itself: that one)."""
    target = locate(args.dir, args.command)
    storage = target.storage
    if target.folder is not None or dcp_folders.is_dcp_directory(storage):
        return dcp_commands.dcp_list(args, storage, target.folder)
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
        print_json({"checkpoint_dir": storage.url, "latest": latest, "tags": entries})
        return EXIT_OK
    if not entries:
        print_err(f"no checkpoints in {storage.url}")
        return EXIT_OK
    rows = [["TAG", "STATUS", "SIZE", "LAYOUT", "CREATED (UTC)"]]
    for e in entries:
        status = ("complete" if e["complete"] else "incomplete") + (", latest" if e["latest"] else "")
        rows.append([e["tag"], status, format_bytes(e["size"]), e["layout_text"], e["created"]])
    print_table(rows)
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
    """``verify``: one tag (or ``--all`` complete ones), fully or ``--quick`` (a DCP or HF checkpoint folder named
    itself: that one); exit status 1 if any has a problem."""
    target = locate(args.dir, args.command, args.tag)
    storage = target.storage
    if target.folder is not None or dcp_folders.is_dcp_directory(storage):
        return dcp_commands.dcp_verify(args, storage, target.folder)
    if args.all:
        names = [t.name for t in tags.list_tags(storage)]
        if not names:
            raise CheckpointError(f"no complete checkpoint in {storage.url}")
        checkpoints = [Checkpoint(storage, n) for n in names]
    else:
        checkpoints = [open_tag(args)]
    results = []
    for ckpt in checkpoints:
        result = _verify_one(ckpt, args.quick, args.progress)
        results.append(result)
        for problem in result["problems"]:
            print_err(f"problem: {problem}")
        if args.verbose:
            for note in result["notes"]:
                print_err(f"note: {note}")
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
                detail = f"{result['files_checked']} files, {format_bytes(result['bytes_checked'])} checked by {how}"
            print(f"{ckpt.tag}: {status}: {detail}")
    ok = all(r["ok"] for r in results)
    if args.json:
        print_json({"checkpoint_dir": storage.url, "ok": ok, "tags": results})
    return EXIT_OK if ok else EXIT_FAILED


def cmd_prune(args: argparse.Namespace) -> int:
    """``prune``: delete all but the newest ``--keep`` complete tags (``--dry-run``: only say which)."""
    storage = refuse_folder(args.dir, args.command)
    if dcp_folders.is_dcp_directory(storage):
        return dcp_commands.dcp_prune(args, storage)
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
        print_err(f"could not delete {storage.url}/{name} (see the warning above)")
    return EXIT_FAILED if failed else EXIT_OK
