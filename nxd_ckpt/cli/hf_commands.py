"""``inspect`` and ``verify`` of a Hugging Face safetensors folder (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``): one downloaded from the Hub, exported by
``nxd-ckpt export``, or the last step TorchTitan wrote with ``last_save_in_hf``.

What ``verify`` checks is what the folder allows, and it says which: every header parsed and bounded by its file's
size, every tensor's byte range inside its file, the index's files present and its names in their headers; with
the library's manifests (``nxd_ckpt/``) also every file's size and checksum. The safetensors format itself is
``tools.safetensors_io``' (imported on first use: it imports torch). Headers are read from local files: a folder on
S3 is refused with the way to check it.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from nxd_ckpt.cli.output import EXIT_OK, PROG, print_json, print_table
from nxd_ckpt.errors import CheckpointError, IntegrityError
from nxd_ckpt.format import dcp_folders, layout
from nxd_ckpt.format.manifests import FileRecord, check_record, hash_stream, read_manifests
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import Storage

if TYPE_CHECKING:
    from nxd_ckpt.tools.verification import VerifyReport

safetensors_io = lazy_module("nxd_ckpt.tools.safetensors_io")
verification = lazy_module("nxd_ckpt.tools.verification")

NO_CHECKSUMS = (
    "written without nxd_ckpt manifests (downloaded from the Hub, or by another writer): every header was parsed "
    "and bounded by its file's size and every tensor's byte range checked inside its file; the tensor bytes "
    "themselves could not be verified (safetensors records no checksums)"
)
HEADERS_CHECKED = "every safetensors header and tensor byte range"


def _local_dir(storage: Storage, folder: str) -> str:
    """The folder on this host's filesystem; CheckpointError for remote storage."""
    local = storage.local_path(folder)
    if local is None:
        raise CheckpointError(
            f"{storage.url}/{folder} is a Hugging Face folder on remote storage: its safetensors headers are checked "
            f"on local files; copy it first (e.g. aws s3 sync {storage.url}/{folder} DIR), then: {PROG} verify DIR"
        )
    return local


def _safetensors_files(storage: Storage, folder: str) -> list[str]:
    return sorted(n for n in storage.list_dir(folder) if n.endswith(layout.SAFETENSORS_SUFFIX))


def _read_index(storage: Storage, folder: str, local: str, files: list[str], report: VerifyReport) -> dict[str, str]:
    """The index's weight_map ({} without an index, or when it is unreadable: a problem); its missing files are
    problems, files it does not name are notes (loaders never open them)."""
    if not storage.exists(f"{folder}/{layout.HF_INDEX_FILE}"):
        return {}
    index = f"{local}/{layout.HF_INDEX_FILE}"
    try:
        weight_map = safetensors_io.read_weight_map(index)
    except CheckpointError as e:
        report.problems.append(str(e))
        return {}
    named = set(weight_map.values())
    for name in sorted(named - set(files)):
        report.problems.append(f"{local}/{name} is missing ({index} maps tensors to it)")
    for name in sorted(set(files) - named):
        report.notes.append(f"{local}/{name} is not named by {layout.HF_INDEX_FILE}: loaders never open it")
    return weight_map


def _check_headers(local: str, files: list[str], report: VerifyReport) -> tuple[dict[str, str], set[str]]:
    """Parse every file's header (bounded by the file's size, byte ranges inside it): {tensor: file} and the
    names of the intact files. Each bad file is a problem naming it."""
    where: dict[str, str] = {}
    intact: set[str] = set()
    for name in files:
        try:
            entries = safetensors_io.SafetensorsSource(f"{local}/{name}").entries()
        except CheckpointError as e:
            report.problems.append(str(e))
            continue
        intact.add(name)
        for entry in entries:
            if entry.name in where:
                report.problems.append(f"{entry.name} is in both {local}/{where[entry.name]} and {local}/{name}")
            where[entry.name] = name
    return where, intact


def _check_weight_map(
    local: str, weight_map: dict[str, str], where: dict[str, str], intact: set[str], report: VerifyReport
) -> None:
    """Every tensor the index maps to an intact file is in that file's header (a loader would fail on it)."""
    for tensor, name in sorted(weight_map.items()):
        if name in intact and where.get(tensor) != name:
            found = f"it is in {where[tensor]}" if tensor in where else "no file holds it"
            report.problems.append(f"{local}/{layout.HF_INDEX_FILE} maps {tensor} to {name}, but {found}")


def _check_digests(storage: Storage, folder: str, index: dict[str, FileRecord], report: VerifyReport) -> None:
    """Every file the manifests list against its size and checksum (streamed); every safetensors file and the
    index listed."""
    for rel, rec in sorted(index.items()):
        path = f"{folder}/{rel}"
        try:
            with storage.open_read(path) as f:
                check_record(storage.url, folder, path, rec, *hash_stream(f))
        except FileNotFoundError:
            report.problems.append(f"{storage.url}/{path} is missing (listed in rank {rec.rank}'s manifest)")
            continue
        except IntegrityError as e:
            report.problems.append(str(e))
        report.bytes_checked += rec.size
    unlisted = [n for n in _safetensors_files(storage, folder) if n not in index]
    if storage.exists(f"{folder}/{layout.HF_INDEX_FILE}") and layout.HF_INDEX_FILE not in index:
        unlisted.append(layout.HF_INDEX_FILE)
    for name in unlisted:
        report.problems.append(
            f"{storage.url}/{folder}/{name} is in no nxd_ckpt manifest of the folder: its contents cannot be checked"
        )


def verify_folder(storage: Storage, folder: dcp_folders.DcpFolder) -> tuple[VerifyReport, str]:
    """Check the Hugging Face folder ``folder`` of ``storage``; the report (problems name their file; nothing
    raises for a damaged folder) and what was checked, in words."""
    start = time.perf_counter()
    report = verification.VerifyReport(checkpoint_dir=storage.url, tag=folder.name, complete=folder.complete)
    local = _local_dir(storage, folder.name)
    if not folder.complete:
        report.problems.append(
            f"{local} has neither {layout.HF_INDEX_FILE} nor {layout.HF_SINGLE_FILE}: an unfinished save (the "
            "index is written last), or not a Hugging Face folder"
        )
    files = _safetensors_files(storage, folder.name)
    weight_map = _read_index(storage, folder.name, local, files, report)
    where, intact = _check_headers(local, files, report)
    _check_weight_map(local, weight_map, where, intact, report)
    found = read_manifests(storage, folder.name, check_metadata=False)
    report.problems += [str(p) for p in found.problems]
    report.manifests = len(found.ranks)
    if found.index:
        _check_digests(storage, folder.name, found.index, report)
        how = f"checksums from {report.manifests} manifests and {HEADERS_CHECKED}"
    else:
        report.notes.append(NO_CHECKSUMS)
        how = f"{HEADERS_CHECKED} (no checksums: safetensors records none)"
    report.files_checked = len(files) + (1 if weight_map else 0)
    report.seconds = time.perf_counter() - start
    return report, how


def describe_folder(storage: Storage, folder: dcp_folders.DcpFolder) -> dict[str, Any]:
    """The tensors (name, dtype, shape, bytes, file) and files of the Hugging Face folder, from the headers only;
    CheckpointError naming a file whose header is invalid."""
    local = _local_dir(storage, folder.name)
    tensors = []
    for name in _safetensors_files(storage, folder.name):
        for e in safetensors_io.SafetensorsSource(f"{local}/{name}").entries():
            dtype = str(e.dtype).removeprefix("torch.")
            tensors.append({"name": e.name, "dtype": dtype, "shape": list(e.shape), "nbytes": e.nbytes, "file": name})
    files = [(p[len(folder.name) + 1 :], storage.size(p)) for p in storage.walk_files(folder.name)]
    return {
        "path": local,
        "format": dcp_folders.HF,
        "complete": folder.complete,
        "index": storage.exists(f"{folder.name}/{layout.HF_INDEX_FILE}"),
        "manifests": folder.manifests,
        "files": [{"path": p, "size": s} for p, s in files],
        "tensors": tensors,
    }


def hf_inspect(args: argparse.Namespace, storage: Storage, folder: dcp_folders.DcpFolder) -> int:
    """``inspect``: the folder's tensors and files, from the headers only (no tensor data is read)."""
    desc = describe_folder(storage, folder)
    if args.json:
        print_json(desc)
        return EXIT_OK
    tensors = desc["tensors"]
    checksums = f"{desc['manifests']} nxd_ckpt manifests" if desc["manifests"] else "no checksums (safetensors)"
    total = format_bytes(sum(t["nbytes"] for t in tensors))
    n_files = len({t["file"] for t in tensors})
    print(f"{desc['path']}: Hugging Face safetensors, {len(tensors)} tensors in {n_files} files, {total}, {checksums}")
    print("files:")
    print_table([[f"  {f['path']}", format_bytes(f["size"])] for f in desc["files"]])
    print("tensors:")
    rows = [
        [f"  {t['name']}", t["dtype"], "x".join(map(str, t["shape"])), format_bytes(t["nbytes"]), t["file"]]
        for t in tensors
    ]
    print_table(rows or [["  (none)"]])
    return EXIT_OK
