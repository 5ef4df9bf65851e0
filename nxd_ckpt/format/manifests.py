"""``<tag>/nxd_ckpt/manifest_rank_RRRRR.json``: the per-rank lists of files with size and xxh3_64 digest.

Each file's record also holds the digests of its blocks (``FileRecord.blocks``), so a load can check exactly the
byte ranges it reads, before it uses them, without reading the rest of the file. A block ends every
``BLOCK_BYTES`` bytes and wherever the writer starts a new item (``BlockHasher.cut``: a DCP item, so an item's
bytes are whole blocks), and the first block of an item is only ``HEAD_BYTES`` long (its zip header: what a
reader parses first). The whole-file digest stays (``verify`` checks whole files). Records written before
block digests existed (format version 1) have none and still parse: loads check such files whole.

The only module that writes, parses or finds manifests. ``read_manifests`` is the one reader: it merges every
rank's manifest, checks each one's own seal, and checks that every rank the metadata names has one. Callers
choose what to do with the problems: the load path (``read_index``) raises the first, ``verify`` lists them all.
``split_index`` cuts the merged index into per-rank shares (``IndexShare``) for loads.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from nxd_ckpt.errors import FormatError, IntegrityError
from nxd_ckpt.format import layout
from nxd_ckpt.format.hashing import Hasher, hash_bytes
from nxd_ckpt.format.metadata import TagMetadata, metadata_path
from nxd_ckpt.storage import Storage, check_relative_path

ALGORITHM = "xxh3_64"
MANIFEST_FORMAT = "nxd_ckpt.manifest"
MANIFEST_VERSION = 2
"""2: records carry block digests (1: whole-file digests only; still read)."""
BLOCK_BYTES = 256 << 10
"""Longest block with its own digest: the most a load reads beyond the byte range it needs, at each end."""
HEAD_BYTES = 64 << 10
"""Length of an item's first block (``BlockHasher.cut``): its zip header and pickle, read on their own."""
MANIFEST_PREFIX = "manifest_rank_"
_CHUNK = 8 << 20
_PIECE = 1 << 20
RESTORE_HINT = (
    "the file changed after it was written (disk or transfer corruption, truncation, or tampering); restore it "
    "from a copy or load another tag (load_checkpoint(..., fallback_to_verified=True) picks the newest intact one)"
)


@dataclass(frozen=True)
class FileRecord:
    """Size and xxh3_64 digest (hex) of one file, the rank whose manifest lists it, and its block digests."""

    size: int
    digest: str
    rank: int = -1
    blocks: tuple[tuple[int, str], ...] = ()
    """``(end offset, xxh3_64 hex)`` of consecutive blocks covering the file (the first starts at 0); empty in
    records written before block digests (a file of them is checked whole)."""

    @functools.cached_property
    def block_ends(self) -> list[int]:
        """The blocks' end offsets, in order (kept: a load asks for them once per range)."""
        return [e for e, _ in self.blocks]

    @property
    def has_blocks(self) -> bool:
        return bool(self.blocks) or self.size == 0

    def blocks_over(self, start: int, end: int) -> list[tuple[int, int, str]]:
        """``(start, end, digest)`` of the blocks holding bytes ``[start, end)`` (none past the recorded size)."""
        if end <= start:
            return []
        ends = self.block_ends
        first = bisect.bisect_right(ends, start)
        out = []
        for i in range(first, len(self.blocks)):
            block_start = ends[i - 1] if i else 0
            if block_start >= end:
                break
            out.append((block_start, ends[i], self.blocks[i][1]))
        return out


class BlockHasher:
    """Hashes a file as it is written, whole and by blocks (``FileRecord.blocks``): a block ends every
    ``BLOCK_BYTES`` bytes and at each ``cut`` (the writer starts an item there), after which the first block is
    ``HEAD_BYTES`` long. Each piece is hashed twice while it is in the CPU cache (whole file, block)."""

    def __init__(self) -> None:
        self._whole = Hasher()
        self._block = Hasher()
        self.size = 0
        self._block_start = 0
        self._limit = BLOCK_BYTES
        self._blocks: list[tuple[int, str]] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, self._limit - (self.size - self._block_start), _PIECE)
            piece = view[pos : pos + take]
            self._whole.update(piece)
            self._block.update(piece)
            self.size += take
            pos += take
            if self.size - self._block_start >= self._limit:
                self._close(BLOCK_BYTES)

    def cut(self) -> None:
        """A new item starts here: end the current block; the next one is ``HEAD_BYTES`` long."""
        self._close(HEAD_BYTES)

    def _close(self, next_limit: int) -> None:
        if self.size > self._block_start:
            self._blocks.append((self.size, self._block.hexdigest()))
            self._block = Hasher()
        self._block_start = self.size
        self._limit = next_limit

    def hexdigest(self) -> str:
        return self._whole.hexdigest()

    def record(self, rank: int = -1) -> FileRecord:
        """The record of everything hashed so far."""
        self._close(BLOCK_BYTES)
        return FileRecord(self.size, self._whole.hexdigest(), rank, tuple(self._blocks))


def new_hasher() -> Any:
    return Hasher()


def hash_stream(f: BinaryIO) -> tuple[int, str]:
    """(size, digest) of a readable stream from its current position to the end."""
    hasher = new_hasher()
    size = 0
    for piece in _pieces(f):
        hasher.update(piece)
        size += len(piece)
    return size, hasher.hexdigest()


def record_stream(f: BinaryIO, rank: int = -1) -> FileRecord:
    """The record (size, digest, fixed-size block digests) of a readable stream from its position to the end."""
    hasher = BlockHasher()
    for piece in _pieces(f):
        hasher.update(piece)
    return hasher.record(rank)


def _pieces(f: BinaryIO) -> Iterator[memoryview]:
    """``f`` from its position to the end, one reused ``_CHUNK`` buffer at a time (each view valid until the next)."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = f.readinto(buf) if hasattr(f, "readinto") else _read_into(f, buf)
        if not n:
            return
        yield view[:n]


def record_bytes(data: Any, rank: int = -1) -> FileRecord:
    """The record (size, digest, fixed-size block digests) of a buffer."""
    hasher = BlockHasher()
    hasher.update(data)
    return hasher.record(rank)


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
        "format_version": MANIFEST_VERSION if any(rec.blocks for rec in records.values()) else 1,
        "algorithm": ALGORITHM,
        "tag": tag,
        "rank": rank,
        "files": {path: _entry(rec) for path, rec in sorted(records.items())},
    }
    head = {k: v for k, v in body.items() if k != "files"}
    head["checksum"] = hash_bytes(_canonical(body))[1]
    lines = [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    files = ",\n".join(f"  {json.dumps(p)}: {json.dumps(v)}" for p, v in body["files"].items())
    return ("{\n" + "\n".join(lines) + '\n"files": {\n' + files + "\n}\n}\n").encode()


def _entry(rec: FileRecord) -> list[Any]:
    """A file's entry in a manifest: ``[size, digest]``, then ``[[block end, digest], ...]`` where it has blocks."""
    if not rec.blocks:
        return [rec.size, rec.digest]
    return [rec.size, rec.digest, [[end, digest] for end, digest in rec.blocks]]


def _record(entry: Any, rank: int) -> FileRecord:
    """A file's record from its manifest entry (either version); ValueError if it is malformed."""
    size, digest, *rest = entry
    blocks: tuple[tuple[int, str], ...] = ()
    if rest:
        blocks = tuple((int(end), str(d)) for end, d in rest[0])
        ends = [end for end, _ in blocks]
        if any(b <= a for a, b in zip([0, *ends], ends, strict=False)) or (ends and ends[-1] != int(size)):
            raise ValueError("its block records do not cover the file in order")
    return FileRecord(int(size), str(digest), rank, blocks)


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
        if int(doc.get("format_version", 1)) > MANIFEST_VERSION:
            raise ValueError(f"format version {doc['format_version']} is newer than this nxd_ckpt reads: upgrade it")
        rank = int(doc["rank"])
        records = {check_relative_path(str(p)): _record(v, rank) for p, v in doc["files"].items()}
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


def block_error(
    url: str, tag: str, path: str, rec: FileRecord, start: int, end: int, found: str | int
) -> IntegrityError:
    """The error for block ``[start, end)`` of ``url/path`` not matching its record: ``found`` is its digest, or
    how many of its bytes the file has (a truncated file)."""
    manifest = layout.manifest_file(tag, rec.rank) if rec.rank >= 0 else "its manifest"
    if isinstance(found, int):
        what = f"is corrupt: it has {start + found} bytes but {rec.size} were written (truncated)"
    else:
        what = (
            f"is corrupt: its bytes {start}-{end} have {ALGORITHM} checksum {found} but a different one was "
            "recorded when they were written"
        )
    return IntegrityError(f"{url}/{path} {what} (see {manifest}); {RESTORE_HINT}")


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
