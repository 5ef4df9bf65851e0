"""``inspect`` and ``verify`` of a Hugging Face safetensors folder (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``): one downloaded from the Hub, exported by
``nxd-ckpt export``, or the last step TorchTitan wrote with ``last_save_in_hf``.

What ``verify`` checks is ``tools.hf_folder``'s (the checks an initial load runs, every problem collected): every
header parsed and bounded by its file's size, every tensor's byte range inside its file and the data covered
exactly, the index's files present and its names in their headers; with the library's manifests (``nxd_ckpt/``)
also every file's size and checksum. This module only reports; ``tools.hf_folder`` (imported on first use: it
imports torch, which ``list`` never needs) owns the checks. Headers are read from local files: a folder on S3 is
refused with the way to check it.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from nxd_ckpt.cli.output import EXIT_OK, PROG, print_json, print_table
from nxd_ckpt.errors import CheckpointError
from nxd_ckpt.format import dcp_folders, layout
from nxd_ckpt.lazy import lazy_module
from nxd_ckpt.log import format_bytes
from nxd_ckpt.storage import Storage

if TYPE_CHECKING:
    from nxd_ckpt.tools.verification import VerifyReport

hf_folder = lazy_module("nxd_ckpt.tools.hf_folder")
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


def verify_folder(storage: Storage, folder: dcp_folders.DcpFolder) -> tuple[VerifyReport, str]:
    """Check the Hugging Face folder ``folder`` of ``storage`` (``tools.hf_folder.survey_folder``): the
    ``VerifyReport`` (problems name their file; nothing raises for a damaged folder) and what was checked, in
    words."""
    start = time.perf_counter()
    report = verification.VerifyReport(checkpoint_dir=storage.url, tag=folder.name, complete=folder.complete)
    local = _local_dir(storage, folder.name)
    if not folder.complete:
        report.problems.append(
            f"{local} has neither {layout.HF_INDEX_FILE} nor {layout.HF_SINGLE_FILE}: an unfinished save (the "
            "index is written last), or not a Hugging Face folder"
        )
    check = hf_folder.survey_folder(local)
    report.problems += [str(p) for p in check.problems]
    report.notes += check.notes
    report.manifests = check.manifests
    report.bytes_checked = check.checksummed_bytes
    if check.manifests:
        how = f"checksums from {check.manifests} manifests and {HEADERS_CHECKED}"
    else:
        report.notes.append(NO_CHECKSUMS)
        how = f"{HEADERS_CHECKED} (no checksums: safetensors records none)"
    report.files_checked = check.files_checked
    report.seconds = time.perf_counter() - start
    return report, how


def describe_folder(storage: Storage, folder: dcp_folders.DcpFolder) -> dict[str, Any]:
    """The tensors (name, dtype, shape, bytes, file) and files of the Hugging Face folder, from the headers only;
    CheckpointError naming a file whose header is invalid."""
    local = _local_dir(storage, folder.name)
    tensors = []
    for name in hf_folder.shard_names(local):
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
