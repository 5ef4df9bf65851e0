"""TorchTitan's Hugging Face checkpoints through the library: the last step written as a safetensors set, and
Hugging Face weights checked before an initial load reads them.

Saving (``save_hf``) writes what TorchTitan 0.3.0's manager writes with ``last_save_in_hf=True`` (its
``HuggingFaceStorageWriter`` and consolidation): ``model-0000i-of-0000N.safetensors`` files numbered as the
``sd_adapter``'s ``fqn_to_index_mapping`` (from ``hf_assets_path``'s index; one file ``model-00001-of-00001`` without
one), tensors in that mapping's order, and ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``). What differs: the files go through ``tools/safetensors_io``'s writer and the library's storage
(``s3://`` too), each is checksummed into the rank's manifest, the index is written last through the commit DCP
folders use (``save.commit`` with ``layout.HF_COMMIT``: staged in a hidden sibling and swapped in whole), and no
``sharded/`` copy is made: ``DTensor`` state is gathered one tensor at a time (every rank takes part in each
gather; the rank that owns the tensor's file writes it at once), so a rank holds one tensor, not a file.

Loading: ``check_hf_folder_on_all_ranks`` runs ``tools.hf_folder.check_folder`` (a folder this module wrote against
its manifests; any folder with the checks its format allows, and each tensor against the model) on rank 0 before
DCP's reader reads a byte; every error names the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from nxd_ckpt.dcp.checkin import check_recorded
from nxd_ckpt.dcp.place import CheckpointPlace
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import hash_bytes
from nxd_ckpt.format.integrity import ChecksummingStorage
from nxd_ckpt.format.layout import HF_COMMIT
from nxd_ckpt.format.manifests import FileRecord, manifest_bytes, parse_manifest
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.save import commit
from nxd_ckpt.storage import Storage
from nxd_ckpt.tools import safetensors_io
from nxd_ckpt.tools.hf_folder import Expected, check_folder
from nxd_ckpt.tools.safetensors_io import FileWriter, TensorEntry
from nxd_ckpt.watchdog import StorageMonitor, run_watched

T = TypeVar("T")

INDEX_FILE = layout.HF_INDEX_FILE
FILE_METADATA = {"format": "pt"}
"""Each file's ``__metadata__``, as ``save_pretrained`` writes it (``transformers`` checks it)."""


@dataclass(frozen=True)
class HfFile:
    """One file of the set: its name, its tensors in order, and the rank that writes it."""

    name: str
    entries: tuple[TensorEntry, ...]
    rank: int


def _is_dtensor(t: torch.Tensor) -> bool:
    """A ``DTensor`` (told by its interface, as ``dcp.stager`` tells it)."""
    return callable(getattr(t, "full_tensor", None)) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def plan_files(hf_state: Mapping[str, Any], fqn_to_index: Mapping[str, int] | None, world: int) -> list[HfFile]:
    """The files of ``hf_state`` as TorchTitan names and fills them: ``fqn_to_index`` (name -> 1-based file number;
    None: one file) and the mapping's order within a file; file ``i`` written by rank ``i % world``, as TorchTitan's
    consolidation splits them. ValueError for a value that is no tensor or a tensor the mapping does not place."""
    others = [k for k, v in hf_state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise ValueError(
            f"last_save_in_hf: safetensors holds tensors only, but the Hugging Face state dict has other values: "
            f"{', '.join(others[:5])}; save with last_save_in_hf=False"
        )
    entries = {k: TensorEntry(k, v.dtype, tuple(v.shape)) for k, v in hf_state.items()}
    for e in entries.values():
        safetensors_io.dtype_code(e.dtype, e.name)
    if not fqn_to_index:
        return [HfFile(safetensors_io.shard_file_name(1, 1), tuple(entries.values()), 0)]
    unplaced = [k for k in entries if k not in fqn_to_index]
    if unplaced:
        raise ValueError(
            f"last_save_in_hf: {', '.join(unplaced[:5])} (of {len(unplaced)}) are not in the weight_map of "
            f"hf_assets_path's {INDEX_FILE}; use the index of this model's own Hugging Face weights"
        )
    count = max(fqn_to_index.values())
    by_index: dict[int, list[TensorEntry]] = {}
    for name, index in fqn_to_index.items():
        if name in entries:
            by_index.setdefault(int(index), []).append(entries[name])
    return [HfFile(safetensors_io.shard_file_name(i, count), tuple(by_index[i]), i % world) for i in sorted(by_index)]


def fqn_to_index_of(sd_adapter: Any) -> dict[str, int] | None:
    """The adapter's ``fqn_to_index_mapping`` (TorchTitan's ``StateDictAdapter`` reads it from ``hf_assets_path``'s
    index), None when it has none."""
    mapping = getattr(sd_adapter, "fqn_to_index_mapping", None)
    return dict(mapping) if mapping else None


# ---------------------------------------------------------------------------------------------------- saving
def save_hf(
    hf_state: Mapping[str, Any], path: str, fqn_to_index: Mapping[str, int] | None, timeout_s: float | None = None
) -> list[str]:
    """(Collective: every rank, the same ``hf_state`` keys.) Write ``hf_state`` into the folder ``path`` (a local
    path or ``s3://``) as a Hugging Face safetensors set, committed crash-safely; returns the file names. Every
    storage call runs under the deadline ``timeout_s`` (default ``NXD_CKPT_TIMEOUT_S``), as the DCP writer's."""
    coordinator = Coordinator(timeout_s=timeout_s)
    files = plan_files(hf_state, fqn_to_index, coordinator.world_size)
    place = CheckpointPlace.of(path)
    deadline = resolve_timeout(timeout_s)

    def watched(what: str, fn: Callable[[CheckpointPlace, StorageMonitor], T]) -> T:
        monitor = StorageMonitor(f"{what} Hugging Face checkpoint {path}", deadline, url=place.root.url)
        return run_watched(lambda: fn(place.watched(monitor), monitor), monitor, name="nxd_ckpt_hf")

    staged = coordinator.master_computes(
        lambda: watched("preparing", lambda p, _: commit.prepare_folder(p.root, p.folder, p.path, HF_COMMIT)),
        f"preparing Hugging Face checkpoint {path}",
    )
    rank = coordinator.rank
    coordinator.run_all(
        lambda: watched("writing", lambda p, m: _write_rank(p, staged, files, hf_state, rank, m)), f"writing {path}"
    )
    coordinator.master_computes(
        lambda: watched("committing", lambda p, _: _commit(p, staged, files, coordinator.world_size)),
        f"committing {path}",
    )
    return [f.name for f in files]


def _write_rank(
    place: CheckpointPlace,
    staged: bool,
    files: list[HfFile],
    hf_state: Mapping[str, Any],
    rank: int,
    monitor: StorageMonitor,
) -> None:
    """This rank's files, then its manifest. Every rank walks every file's tensors in the same order, so each
    ``DTensor`` is gathered with every rank taking part; a rank that fails to write keeps taking part (so no rank
    waits on it in a gather) and raises at the end."""
    folder = place.folder
    storage = ChecksummingStorage(commit.staged_storage(place.root, folder, staged, HF_COMMIT), folder, rank)
    error: BaseException | None = None
    for file in files:
        gathered = [False]
        try:
            if file.rank == rank and error is None:
                with storage.open_write(f"{folder}/{file.name}") as f:
                    _stream_file(f, file, hf_state, monitor, gathered)
                continue
        except Exception as e:
            error = e
        if not gathered[0]:
            _stream_file(None, file, hf_state, monitor, gathered)  # take part in the gathers only
    if error is not None:
        raise error
    storage.write_manifest()


def _stream_file(
    f: Any, file: HfFile, hf_state: Mapping[str, Any], monitor: StorageMonitor, gathered: list[bool]
) -> None:
    """Gather each tensor of ``file`` (a ``DTensor``: from every rank) and, where ``f`` is a file, stream it there;
    one tensor alive at a time. A failed write stops the writing, not the gathers (``gathered[0]`` is set once
    they are all done), and is raised after them."""
    writer = FileWriter(f, file.entries, FILE_METADATA) if f is not None else None
    error: Exception | None = None
    for entry in file.entries:
        value = hf_state[entry.name]
        if _is_dtensor(value):
            with monitor.waiting_off_storage():  # a collective, not storage
                value = value.full_tensor()
        if writer is not None and error is None:
            try:
                writer.write(entry.name, value.detach().to("cpu"))
            except Exception as e:
                error = e
        del value
    gathered[0] = True
    if error is not None:
        raise error


def _commit(place: CheckpointPlace, staged: bool, files: list[HfFile], world: int) -> None:
    """Coordinator, every rank's files written: each checked as recorded in full by its rank's manifest, the index
    recorded in the coordinator's manifest, then written last and the staged folder swapped in."""
    storage = commit.staged_storage(place.root, place.folder, staged, HF_COMMIT)
    needed = {f.name: safetensors_io.file_size(f.entries, FILE_METADATA) for f in files}
    records = _recorded_files(storage, place, world, needed)
    index = safetensors_io.index_bytes(safetensors_io.index_document([(f.name, f.entries) for f in files]))
    own = {rel: rec for rel, rec in records.items() if rec.rank == 0}
    own[INDEX_FILE] = FileRecord(*hash_bytes(index), 0)
    manifest = layout.manifest_file(place.folder, 0)
    storage.write_bytes(manifest, manifest_bytes(place.folder, 0, own))
    storage.sync_dirs([manifest.rsplit("/", 1)[0]])
    commit.complete_folder(storage, place.folder, index, place.root if staged else None, HF_COMMIT)


def _recorded_files(
    storage: Storage, place: CheckpointPlace, world: int, needed: dict[str, int]
) -> dict[str, FileRecord]:
    """Coordinator: every rank's manifest of the folder merged, each file recorded in full (``needed``: file ->
    size); CheckpointError naming the ranks without a manifest or the first file short of its bytes. The last
    step is written once a job, so its commit reads the ranks' manifests back (DCP's saves carry them instead)."""
    per_rank: dict[int, dict[str, FileRecord]] = {}
    for rank in range(world):
        manifest = layout.manifest_file(place.folder, rank)
        if storage.exists(manifest):
            per_rank[rank] = parse_manifest(storage.read_bytes(manifest), f"{storage.url}/{manifest}")[1]
    check_recorded(per_rank, world, needed, place.path)
    return {rel: rec for records in per_rank.values() for rel, rec in records.items()}


# ---------------------------------------------------------------------------------------------------- loading
def check_hf_folder_on_all_ranks(path: str, expected: Mapping[str, Expected] | None, timeout_s: float | None) -> None:
    """(Collective.) ``tools.hf_folder.check_folder`` on rank 0 (each file read once, not once per rank); its error
    raised on every rank."""
    Coordinator(timeout_s=timeout_s).master_computes(
        lambda: check_folder(path, expected), f"checking Hugging Face weights {path}"
    )
