"""A checkpoint's model state, at any TP/PP layout, as one consolidated set outside nxd_ckpt's format.

Formats: a Hugging Face-style safetensors set (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``,
``tools/safetensors_io``), one ``.safetensors`` file, or a torch Distributed Checkpoint (``tools/dcp_io``) that
stock ``torch.distributed.checkpoint.load`` reads into a full state dict or into DTensors on any world size.
Tensors are read one at a time from the tag (``tools/model_source``: TP shards merged, PP stages unioned,
verified reads) and written as they come, so memory stays at about twice the largest tensor. Names are NxD's
state-dict names unless a rename map says otherwise. The output appears complete or not at all (built beside
its final name and renamed into place).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nxd_ckpt.errors import CheckpointError, FormatError
from nxd_ckpt.inspection import Checkpoint
from nxd_ckpt.tools import dcp_io, safetensors_io
from nxd_ckpt.tools.model_source import CheckpointModel, ShardingSource
from nxd_ckpt.tools.optimum_layout import ExportNotSupportedError as ExportNotSupportedError  # its public name
from nxd_ckpt.tools.optimum_layout import OptimumModel, read_metadata
from nxd_ckpt.tools.safetensors_io import TensorEntry
from nxd_ckpt.tools.user_files import read_json_object

FORMATS = ("safetensors", "dcp")


@dataclass
class ExportReport:
    out: str
    format: str = "safetensors"
    tensors: int = 0
    nbytes: int = 0
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Object paths of non-tensor values, which the output formats' tensor sets cannot hold."""
    largest_tensor_bytes: int = 0


# ---------------------------------------------------------------------------------------------- renaming


class RenameMap:
    """Renames state-dict names: exact pairs first, then regular-expression patterns in order (first match).

    A file is JSON: ``{"old.name": "new.name", ...}`` (exact), or ``{"exact": {...}, "patterns": [["regex",
    "replacement"], ...]}``; replacements use Python's ``re.sub`` syntax (``\\1``). Names no rule matches stay.
    """

    def __init__(self, exact: Mapping[str, str] | None = None, patterns: Sequence[tuple[str, str]] = ()) -> None:
        self.exact = dict(exact or {})
        self.patterns: list[tuple[re.Pattern[str], str]] = []
        for regex, repl in patterns:
            try:
                self.patterns.append((re.compile(regex), repl))
            except re.error as e:
                raise ValueError(f"rename pattern {regex!r} is not a valid regular expression: {e}") from e

    @classmethod
    def from_file(cls, path: str) -> RenameMap:
        doc = read_json_object(path, "rename map", "a JSON object")
        if set(doc) <= {"exact", "patterns"} and doc:
            exact, patterns = doc.get("exact") or {}, doc.get("patterns") or []
        else:
            exact, patterns = doc, []
        if not isinstance(exact, dict) or not all(isinstance(v, str) for v in exact.values()):
            raise ValueError(f"rename map {path}: exact renames must be an object of name -> new name")
        if not isinstance(patterns, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in patterns
        ):
            raise ValueError(f'rename map {path}: "patterns" must be a list of ["regex", "replacement"] pairs')
        return cls(exact, [(a, b) for a, b in patterns])

    @classmethod
    def from_pairs(cls, pairs: Sequence[str]) -> RenameMap:
        """From ``REGEX=REPLACEMENT`` strings (the command line's ``--rename-pattern``)."""
        out = []
        for pair in pairs:
            regex, sep, repl = pair.partition("=")
            if not sep or not regex:
                raise ValueError(f"--rename-pattern takes REGEX=REPLACEMENT, got {pair!r}")
            out.append((regex, repl))
        return cls(patterns=out)

    def then(self, other: RenameMap) -> RenameMap:
        """This map's rules, then ``other``'s (exact renames of both first)."""
        merged = RenameMap({**self.exact, **other.exact})
        merged.patterns = self.patterns + other.patterns
        return merged

    def __call__(self, name: str) -> str:
        if name in self.exact:
            return self.exact[name]
        for regex, repl in self.patterns:
            if regex.search(name):
                return regex.sub(repl, name)
        return name

    def apply(self, names: Sequence[str]) -> dict[str, str]:
        """old -> new for every name; ValueError if two names end up the same or one becomes empty."""
        out = {n: self(n) for n in names}
        seen: dict[str, str] = {}
        for old, new in out.items():
            if not new:
                raise ValueError(f"the rename map turns {old!r} into an empty name")
            if new in seen:
                raise ValueError(f"the rename map gives {seen[new]!r} and {old!r} the same name {new!r}")
            seen[new] = old
        return out


# ---------------------------------------------------------------------------------------------- export


def export(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    sharding: ShardingSource = None,
    rename: RenameMap | None = None,
    max_shard_bytes: int = safetensors_io.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write the model state of ``ckpt`` (any TP/PP layout) to ``out`` as one consolidated set.

    Args:
        out: a directory to create (a safetensors set, or a DCP checkpoint with ``format="dcp"``), or a path
            ending in ``.safetensors`` for one file.
        sharding: how tensors are split over TP ranks when the tag does not record it (NxD-written tags at TP>1):
            a ``ShardingRecord``, name patterns -> partition dim / (dim, stride) / None, or a model.
        rename: renames of NxD's state-dict names.
        max_shard_bytes: safetensors sets: the largest file (a bigger tensor gets a file of its own).
        overwrite: replace an existing ``out`` (the new one is complete before the old one goes).
        verify: check each source file against the tag's manifests before using it.
        progress: called with the bytes of each tensor written.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    out = os.path.abspath(os.fspath(out))
    single = out.endswith(".safetensors")
    if single and format != "safetensors":
        raise ValueError(f"{out}: a .safetensors file name needs format='safetensors'; DCP writes a directory")
    if os.path.lexists(out) and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --force (overwrite=True) to replace it")
    optimum = read_metadata(ckpt)  # an optimum-neuron tag: the tensors its consolidation writes
    if optimum is not None:
        model: CheckpointModel | OptimumModel = OptimumModel(ckpt, optimum, sharding, verify=verify)
    else:
        model = CheckpointModel(ckpt, sharding, verify=verify)
    entries = model.entries()
    names = (rename or RenameMap()).apply([e.name for e in entries])
    renamed = [TensorEntry(names[e.name], e.dtype, e.shape) for e in entries]
    report = ExportReport(out=out, format=format, skipped=list(model.skipped))
    report.largest_tensor_bytes = max((e.nbytes for e in entries), default=0)
    by_new_name = {names[e.name]: e.name for e in entries}

    def read(new_name: str) -> torch.Tensor:
        tensor = model.read(by_new_name[new_name])
        report.tensors += 1
        report.nbytes += tensor.numel() * tensor.element_size()
        if progress is not None:
            progress(tensor.numel() * tensor.element_size())
        return tensor

    def stream() -> Iterator[torch.Tensor]:
        for e in renamed:
            yield read(e.name)

    metadata = {"format": "pt", "nxd_ckpt_source": ckpt.url}

    def build(target: str) -> list[str]:
        if format == "dcp":
            dcp_io.write_dcp(target, [(e.name, e.dtype, e.shape) for e in renamed], read)
            return sorted(os.listdir(target))
        if single:
            safetensors_io.write_file(target, renamed, stream(), metadata)
            return [os.path.basename(out)]
        return safetensors_io.write_set(target, renamed, stream(), max_shard_bytes=max_shard_bytes, metadata=metadata)

    report.files = _build_in_place(out, build)
    return report


def _build_in_place(out: str, build: Callable[[str], list[str]]) -> list[str]:
    """Build ``out`` at a sibling temporary path, then move it to ``out``; an existing ``out`` is replaced only
    once the new one is complete."""
    if not os.path.lexists(out):
        return build(out)
    parent, base = os.path.split(out)
    new, old = os.path.join(parent, f".{base}.new-{os.getpid()}"), os.path.join(parent, f".{base}.old-{os.getpid()}")
    for stale in (new, old):
        _remove(stale)
    try:
        files = build(new)
    except BaseException:
        _remove(new)
        raise
    os.rename(out, old)
    os.rename(new, out)
    _remove(old)
    return files


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def export_state_file(
    ckpt: Checkpoint, prefix: str, out: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None
) -> ExportReport:
    """Write one state file's tensors (e.g. ``model/tp01_pp00``, as saved: one TP shard) as one safetensors
    file, names relative to the file."""
    sf = next((s for s in ckpt.state_files() if s.prefix == prefix), None)
    if sf is None:
        names = ", ".join(s.prefix for s in ckpt.state_files())
        raise FormatError(f"{ckpt.url} has no state file {prefix!r}; it has: {names}")
    out = os.path.abspath(os.fspath(out))
    report = ExportReport(out=out)
    objects = []
    for obj in ckpt.objects(sf):
        if obj.kind != "tensor":
            report.skipped.append(obj.path)
            continue
        objects.append((obj.path[len(sf.prefix) + 1 :] or obj.path, obj))
    entries = [TensorEntry(name, getattr(torch, obj.dtype or ""), tuple(obj.shape or ())) for name, obj in objects]

    def stream() -> Iterator[torch.Tensor]:
        for _, obj in objects:
            tensor = ckpt.read(obj.path)
            report.tensors += 1
            report.nbytes += obj.nbytes
            if progress is not None:
                progress(obj.nbytes)
            yield tensor

    metadata = {"format": "pt", "nxd_ckpt_source": f"{ckpt.url}/{prefix}"}

    def build(target: str) -> list[str]:
        safetensors_io.write_file(target, entries, stream(), metadata)
        return [os.path.basename(out)]

    report.files = _build_in_place(out, build)
    return report
