"""``<tag>/nxd_ckpt/manifest_rank_RRRRR.json``: the per-rank lists of files with size and xxh3_64 digest.

The only module that writes, parses or finds manifests. ``read_manifests`` is the one reader: it merges every
rank's manifest, checks each one's own seal, and checks that every rank the metadata names has one. Callers
choose what to do with the problems: the load path (``read_index``) raises the first, ``verify`` lists them all.
``split_index`` cuts the merged index into per-rank shares (``IndexShare``) for loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from nxd_ckpt.errors import FormatError, IntegrityError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import Hasher, hash_bytes
from nxd_ckpt.format.metadata import TagMetadata, metadata_path
from nxd_ckpt.storage import Storage, check_relative_path

ALGORITHM = "xxh3_64"
MANIFEST_FORMAT = "nxd_ckpt.manifest"
MANIFEST_VERSION = 1
MANIFEST_PREFIX = "manifest_rank_"
_CHUNK = 8 << 20
RESTORE_HINT = (
    "the file changed after it was written (disk or transfer corruption, truncation, or tampering); restore it "
    "from a copy or load another tag (load_checkpoint(..., fallback_to_verified=True) picks the newest intact one)"
)


@dataclass(frozen=True)
class FileRecord:
    """Size and xxh3_64 digest (hex) of one file, and the rank whose manifest lists it."""

    size: int
    digest: str
    rank: int = -1


def new_hasher() -> Any:
    return Hasher()


def hash_stream(f: BinaryIO) -> tuple[int, str]:
    """(size, digest) of a readable stream from its current position to the end."""
    hasher = new_hasher()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = f.readinto(buf) if hasattr(f, "readinto") else _read_into(f, buf)
        if not n:
            break
        hasher.update(view[:n])
        size += n
    return size, hasher.hexdigest()


def _read_into(f: BinaryIO, buf: bytearray) -> int:
    data = f.read(len(buf))
    buf[: len(data)] = data
    return len(data)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(tag: str, rank: int, records: dict[str, FileRecord]) -> bytes:
    """A manifest: the files (paths within the tag) with size and digest, sealed by a checksum of its body."""
    body = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "algorithm": ALGORITHM,
        "tag": tag,
        "rank": rank,
        "files": {path: [rec.size, rec.digest] for path, rec in sorted(records.items())},
    }
    head = {k: v for k, v in body.items() if k != "files"}
    head["checksum"] = hash_bytes(_canonical(body))[1]
    lines = [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    files = ",\n".join(f"  {json.dumps(p)}: {json.dumps(v)}" for p, v in body["files"].items())
    return ("{\n" + "\n".join(lines) + '\n"files": {\n' + files + "\n}\n}\n").encode()


def parse_manifest(data: bytes, where: str) -> tuple[int, dict[str, FileRecord]]:
    """(rank, records) of a manifest file; IntegrityError naming ``where`` if it is damaged."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ValueError("not an nxd_ckpt manifest")
        checksum = doc.pop("checksum", None)
        if checksum != hash_bytes(_canonical(doc))[1]:
            raise ValueError("its own checksum does not match its content")
        if doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown checksum algorithm {doc.get('algorithm')!r}")
        rank = int(doc["rank"])
        records = {check_relative_path(str(p)): FileRecord(int(s), str(d), rank) for p, (s, d) in doc["files"].items()}
    except (ValueError, KeyError, TypeError) as e:  # InvalidTagError (a path leaving the tag) is a ValueError
        raise IntegrityError(f"manifest {where} is damaged ({e}); {RESTORE_HINT}") from e
    return rank, records


def manifest_paths(storage: Storage, tag: str) -> list[str]:
    """The manifest files of a tag (empty for tags written without manifests)."""
    extras = layout.tag_path(tag, layout.EXTRAS_DIR)
    names = storage.list_dir(extras)
    return [f"{extras}/{n}" for n in names if is_manifest_name(n)]


def is_manifest_name(name: str) -> bool:
    return name.startswith(MANIFEST_PREFIX) and name.endswith(".json")


def check_record(url: str, tag: str, path: str, rec: FileRecord, size: int, digest: str) -> None:
    """Raise IntegrityError naming ``url/path`` unless ``size`` and ``digest`` match the record."""
    if size == rec.size and digest == rec.digest:
        return
    what = (
        f"has {size} bytes but {rec.size} were written"
        if size != rec.size
        else f"has {ALGORITHM} checksum {digest} but {rec.digest} was recorded when it was written"
    )
    manifest = layout.manifest_file(tag, rec.rank) if rec.rank >= 0 else "its manifest"
    raise IntegrityError(f"{url}/{path} is corrupt: it {what} (see {manifest}); {RESTORE_HINT}")


@dataclass
class ManifestSet:
    """Every manifest of a tag merged, and what is wrong with them (each problem names its file)."""

    index: dict[str, FileRecord] = field(default_factory=dict)
    """{path within the tag: record}."""
    ranks: set[int] = field(default_factory=set)
    """Ranks whose manifest was read intact."""
    problems: list[IntegrityError] = field(default_factory=list)
    metadata: TagMetadata | None = None
    """The tag's metadata when its manifest record vouches for it (the source of the expected ranks)."""

    def raise_first(self) -> ManifestSet:
        if self.problems:
            raise self.problems[0]
        return self


def read_manifests(storage: Storage, tag: str, *, check_metadata: bool = True) -> ManifestSet:
    """Read and check every manifest of ``tag`` (nothing for tags written without manifests).

    Problems: a damaged manifest; ``nxd_ckpt.json`` not matching its record (unless not ``check_metadata``:
    ``verify`` checks every listed file itself); a rank the metadata expects (``manifest_ranks``, else
    ``world_size``) without a manifest.
    """
    out = ManifestSet()
    for path in manifest_paths(storage, tag):
        try:
            rank, records = parse_manifest(storage.read_bytes(path), f"{storage.url}/{path}")
        except IntegrityError as e:
            out.problems.append(e)
            continue
        out.ranks.add(rank)
        out.index.update(records)
    if not out.ranks and not out.problems:
        return out  # a tag written without manifests
    meta_path = metadata_path(tag)
    meta_rec = out.index.get(layout.METADATA_FILE)
    try:
        if meta_rec is None and not storage.exists(meta_path):
            return out
        data = storage.read_bytes(meta_path)
        if meta_rec is not None and check_metadata:
            check_record(storage.url, tag, meta_path, meta_rec, *hash_bytes(data))
        out.metadata = TagMetadata.from_json(data, f"{storage.url}/{meta_path}")
    except FileNotFoundError:
        out.problems.append(IntegrityError(f"{storage.url}/{meta_path} is missing (listed in a manifest)"))
        return out
    except FormatError as e:
        out.problems.append(e if isinstance(e, IntegrityError) else IntegrityError(str(e)))
        return out
    expected = out.metadata.expected_manifest_ranks
    missing = sorted(set(expected) - out.ranks) if expected is not None else []
    if missing:
        out.problems.append(
            IntegrityError(
                f"{storage.url}/{layout.manifest_file(tag, missing[0])} is missing or damaged ({len(missing)} of "
                f"{len(expected)} ranks' manifests are): the files those ranks wrote cannot be checked; "
                f"{RESTORE_HINT}"
            )
        )
    return out


def read_index(storage: Storage, tag: str) -> dict[str, FileRecord]:
    """Every manifest of ``tag`` merged (empty without manifests); raises IntegrityError at the first problem."""
    return read_manifests(storage, tag).raise_first().index


@dataclass(frozen=True)
class IndexShare:
    """The part of a tag's merged manifests (``read_index``) one rank's load needs, so that a load need not send
    every rank the whole index (one record per file of the tag: O(world) records per rank, O(world²) in all).

    ``files`` are the state files (paths within the tag) the rank may read; each stands for itself and its xser
    parts (``layout.state_file_of``), and ``records`` holds every record of them the manifests have, so a path
    ``covers`` is exactly as verified as with the whole index. ``files`` None: ``records`` is the whole index.
    """

    records: dict[str, FileRecord]
    files: frozenset[str] | None = None

    def covers(self, rel: str) -> bool:
        """Whether this share answers for ``rel`` (a path within the tag): its record, or that it has none."""
        return self.files is None or layout.state_file_of(rel) in self.files


def split_index(index: dict[str, FileRecord], wanted: Sequence[Iterable[str]]) -> list[IndexShare]:
    """One share of ``index`` per rank: ``wanted[r]`` the files (paths within the tag) rank ``r`` may read. One
    pass over the index, then each share costs the records of its own files. A tag without manifests (empty
    index) gives every rank the whole (empty) index: nothing to check, nothing to fetch."""
    if not index:
        return [IndexShare({}) for _ in wanted]
    by_file: dict[str, dict[str, FileRecord]] = {}
    for rel, rec in index.items():
        by_file.setdefault(layout.state_file_of(rel), {})[rel] = rec
    shares = []
    for files in wanted:
        keys = frozenset(files)
        records: dict[str, FileRecord] = {}
        for key in keys:
            records.update(by_file.get(key, {}))
        shares.append(IndexShare(records, keys))
    return shares


def write_manifest(storage: Storage, tag: str, rank: int, records: dict[str, FileRecord]) -> str:
    path = layout.manifest_file(tag, rank)
    storage.write_bytes(path, manifest_bytes(tag, rank, records))
    return path


def record_files(storage: Storage, tag: str, rels: Iterable[str], rank: int = 0) -> dict[str, FileRecord]:
    """Records of files already on storage (hashed as they are now): for tools that rewrite a tag offline."""
    records: dict[str, FileRecord] = {}
    for rel in rels:
        with storage.open_read(f"{tag}/{rel}") as f:
            records[rel] = FileRecord(*hash_stream(f), rank)
    return records


INDEX_FORMAT = "nxd_ckpt.index"
INDEX_VERSION = 1


def index_bytes(tag: str, manifests: Iterable[bytes]) -> bytes:
    """Every rank's manifest of ``tag`` (each as ``manifest_bytes`` made it, sealed by its own checksum) in one file:
    a DCP commit writes it once, so a load reads one file, not a manifest per rank. The parts are carried as they
    are (no parsing), so whatever a record holds travels unchanged and the cost is a copy of the bytes."""
    body = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "tag": tag}
    body["ranks"] = [m.decode() for m in manifests]
    return json.dumps(body, separators=(",", ":")).encode()


def parse_index(data: bytes, where: str) -> dict[str, FileRecord]:
    """The records of an index file (``index_bytes``), each part checked by ``parse_manifest``; IntegrityError
    naming ``where`` if it is damaged."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
            raise ValueError("not an nxd_ckpt index")
        parts = doc["ranks"]
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise ValueError("its ranks are not a list of manifests")
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"index {where} is damaged ({e}); {RESTORE_HINT}") from e
    records: dict[str, FileRecord] = {}
    for part in parts:
        records.update(parse_manifest(part.encode(), where)[1])
    return records
