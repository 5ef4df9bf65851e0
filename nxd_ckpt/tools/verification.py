"""``verify(checkpoint_dir, tag=None)``: check a whole checkpoint on storage without loading it into a model.

Checks that the tag is complete (``done``), that every file its layout needs is present
(``format.describe.expected_files``, from the metadata or, for NxD-written tags, from the file names), and, for
tags with manifests, that every listed file has the size and xxh3_64 checksum recorded when it was written (and
that every rank's manifest is there). Files no manifest covers (checkpoints written by NxD) are parsed instead:
``torch.save`` archives have their zip CRCs checked and their pickle walked opcode by opcode, which reads the
structure and the class names it would import without executing anything. Last, every state file's structure
is read (``completeness.check_readable``) and xser references are matched with their tensor files. Nothing from
the checkpoint runs. ``nxd-ckpt verify`` calls this same function, so both give the same verdict.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from nxd_ckpt.errors import CheckpointError, CheckpointNotFoundError, FormatError, IntegrityError
from nxd_ckpt.format import layout, manifests, tags
from nxd_ckpt.format.describe import describe, expected_files
from nxd_ckpt.format.metadata import TagMetadata, read_metadata
from nxd_ckpt.serialization.pickle_scan import allowed_globals, scan_torch_file
from nxd_ckpt.storage import Storage, storage_for
from nxd_ckpt.tools import completeness

_MARKERS = {layout.CHECKPOINT_MARKER, layout.DONE_MARKER}


@dataclass
class VerifyReport:
    """The outcome of ``verify``: ``problems`` (each names a file) make it fail; ``notes`` are informational."""

    checkpoint_dir: str
    tag: str
    complete: bool = False
    manifests: int = 0
    files_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """A few lines for logs and the CLI."""
        how = f"checksums from {self.manifests} manifest(s)" if self.manifests else "structure only (no manifests)"
        head = (
            f"{self.checkpoint_dir}/{self.tag}: {'OK' if self.ok else 'FAILED'}, {self.files_checked} files "
            f"({self.bytes_checked / 1e6:.1f} MB) checked by {how} in {self.seconds:.2f} s"
        )
        lines = [head, *(f"  problem: {p}" for p in self.problems), *(f"  note: {n}" for n in self.notes)]
        return "\n".join(lines)

    def raise_if_failed(self) -> VerifyReport:
        """Raise IntegrityError listing the problems, if there are any."""
        if self.problems:
            raise IntegrityError(
                f"checkpoint {self.checkpoint_dir}/{self.tag} failed verification: " + "; ".join(self.problems)
            )
        return self


def verify(checkpoint_dir: str | os.PathLike[str] | Storage, tag: str | None = None) -> VerifyReport:
    """Check ``tag`` (default: the latest complete tag) of ``checkpoint_dir`` without loading it into a model.

    Returns:
        A VerifyReport; ``report.ok`` is False, and ``report.problems`` names each bad file, if anything is wrong.
    """
    storage = storage_for(checkpoint_dir)
    start = time.perf_counter()
    if tag is None:
        tag = tags.latest_tag(storage)
        if tag is None:
            raise CheckpointNotFoundError(f"no complete checkpoint in {storage.url} to verify")
    layout.validate_tag(tag)
    if not storage.list_dir(tag):
        raise CheckpointNotFoundError(f"checkpoint tag {tag!r} does not exist in {storage.url}")
    report = VerifyReport(checkpoint_dir=storage.url, tag=tag)
    _Verifier(storage, tag, report).run()
    report.seconds = time.perf_counter() - start
    return report


class _Verifier:
    def __init__(self, storage: Storage, tag: str, report: VerifyReport) -> None:
        self.storage = storage
        self.tag = tag
        self.report = report
        self.url = f"{storage.url}/{tag}"

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def run(self) -> None:
        report = self.report
        report.complete = self.storage.exists(layout.tag_path(self.tag, layout.DONE_MARKER))
        if not report.complete:
            self.problem(f"{self.url} has no 'done' marker: its save did not finish (or it was being deleted)")
        meta = self._metadata()
        found = manifests.read_manifests(self.storage, self.tag, check_metadata=False)
        self.report.problems += [str(e) for e in found.problems]
        self.report.manifests = len(found.ranks)
        index = found.index
        desc = describe(self.storage, self.tag, metadata=meta)
        why = "the checkpoint's metadata says it was saved" if meta is not None else "the other state files imply it"
        for rel in expected_files(desc):
            if not self.storage.exists(f"{self.tag}/{rel}"):
                self.problem(f"{self.url}/{rel} is missing ({why})")
        for rel, rec in sorted(index.items()):
            self._guarded(rel, lambda rel=rel, rec=rec: self._check_listed(rel, rec))
        manifest_names = {p.rsplit("/", 1)[1] for p in manifests.manifest_paths(self.storage, self.tag)}
        for path in self.storage.walk_files(self.tag):
            rel = path[len(self.tag) + 1 :]
            if rel in index or rel in _MARKERS or ".tmp-" in rel:
                continue
            if rel.startswith(layout.EXTRAS_DIR + "/") and rel.split("/", 1)[1] in manifest_names:
                continue
            if index:
                report.notes.append(f"{self.url}/{rel} is not listed in any manifest; checked its structure only")
            self._guarded(rel, lambda rel=rel: self._check_unlisted(rel))
        for p in completeness.check_readable(completeness.Checkpoint(self.storage, self.tag)):
            where = f"{self.storage.url}/{p.path}"
            if not any(where in known for known in report.problems):  # a check above named this file already
                self.problem(f"{where}: {p.message}")

    def _guarded(self, rel: str, check: Callable[[], None]) -> None:
        """Run one file's check; an unreadable file is a problem naming it, not a crash of the whole verify."""
        try:
            check()
        except (CheckpointError, OSError) as e:
            self.problem(f"{self.url}/{rel} cannot be read: {e}")

    def _metadata(self) -> TagMetadata | None:
        try:
            return read_metadata(self.storage, self.tag)
        except FormatError as e:
            self.problem(str(e))
            return None

    def _check_listed(self, rel: str, rec: manifests.FileRecord) -> None:
        path = f"{self.tag}/{rel}"
        where = f"{self.url}/{rel}"
        if not self.storage.exists(path):
            self.problem(f"{where} is missing (listed in {layout.manifest_file(self.tag, rec.rank)})")
            return
        with self.storage.open_read(path) as f:
            size, digest = manifests.hash_stream(f)
            self.report.files_checked += 1
            self.report.bytes_checked += size
            if size != rec.size:
                self.problem(f"{where} is corrupt: it has {size} bytes but {rec.size} were written")
            elif digest != rec.digest:
                self.problem(
                    f"{where} is corrupt: its {manifests.ALGORITHM} checksum {digest} != recorded {rec.digest}"
                )
            elif rel.endswith(".pt"):
                f.seek(0)
                self._note_unsafe(where, f, check_crc=False)

    def _check_unlisted(self, rel: str) -> None:
        path = f"{self.tag}/{rel}"
        where = f"{self.url}/{rel}"
        with self.storage.open_read(path) as f:
            self.report.files_checked += 1
            self.report.bytes_checked += self.storage.size(path)
            if rel.endswith(".json"):
                try:
                    json.loads(f.read())
                except ValueError as e:
                    self.problem(f"{where} is not valid JSON ({e})")
            elif rel.endswith(".pt"):
                self._note_unsafe(where, f, check_crc=True)

    def _note_unsafe(self, where: str, f: BinaryIO, check_crc: bool) -> None:
        try:
            names = scan_torch_file(f, check_crc=check_crc)
        except FormatError as e:
            self.problem(f"{where} is damaged: {e}")
            return
        unsafe = sorted(names - allowed_globals())
        if unsafe:
            self.report.notes.append(
                f"{where} holds pickled {', '.join(unsafe)}: loading it needs allow_pickle=True (trusted files only)"
            )
