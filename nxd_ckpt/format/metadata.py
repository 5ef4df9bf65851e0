"""``<tag>/nxd_ckpt.json`` as one type: ``TagMetadata``, written and read only through this module.

Every key is documented in docs/format.md. Reading is tolerant: files from older versions (fewer keys) read
with defaults, keys this version does not know are kept and written back unchanged. A file from a newer
``format_version`` is still read (its known keys mean the same thing); a file that is not JSON, or whose
known keys have the wrong type, raises FormatError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nxd_ckpt.errors import FormatError
from nxd_ckpt.format import layout
from nxd_ckpt.format.sharding import ShardingRecord

FORMAT = "nxd_ckpt"
FORMAT_VERSION = 1

_KNOWN = (
    "format",
    "format_version",
    "tag",
    "created_at",
    "layout",
    "zero1",
    "zero1_dp_size",
    "xser",
    "async_save",
    "items",
    "torch_version",
    "zero1_full",
    "converted_from",
    "manifest_ranks",
    "sharding",
)


class FrozenDict(dict):
    """A read-only dict that pickles (sent between ranks) and compares like a dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("TagMetadata is immutable: use with_changes(...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (FrozenDict, (dict(self),))


@dataclass(frozen=True)
class TagMetadata:
    """What nxd_ckpt records about one saved tag (NxD ignores the file)."""

    tag: str
    created_at: float | None
    """Seconds since the epoch when the save began (orders tags; survives copying a directory)."""
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    """DP size the optimizer state is laid out for (the training DP size; after convert-zero1, its target)."""
    cp: int | None = None
    """Context-parallel size of the saving job (NxD: CP ranks hold model replicas; None: not recorded)."""
    ep: int | None = None
    """Expert-parallel size of the saving job (state files carry ``_ep_rank_XX`` when above 1)."""
    world_size: int | None = None
    """Ranks of the job that saved the tag (None after convert-zero1 to full files)."""
    zero1: bool = False
    zero1_dp_size: int | None = None
    """DP size the ZeRO-1 optimizer shards were cut for; None when not ZeRO-1 or merged into full files."""
    xser: bool = False
    items: tuple[str, ...] = ()
    """What was saved: a subset of model, optimizer, scheduler, user_content."""
    torch_version: str | None = None
    format_version: int = FORMAT_VERSION
    zero1_full: bool | None = None
    """True when the ZeRO-1 state is merged into ``optim/full_*`` files (convert-zero1); None: not recorded."""
    converted_from: Mapping[str, Any] | None = None
    """For convert-zero1 outputs: ``{"tag", "zero1_dp_size"}`` of the input."""
    manifest_ranks: int | None = None
    """How many per-rank manifests the tag has (ranks 0..n-1); None: one per rank of ``world_size``."""
    saved_async: bool | None = None
    """Whether the save was asynchronous (``async_save``): a resume of such a tag prepares the next async save
    (``load.pipeline``); None: not recorded (tags written before this key, or by tools)."""
    sharding: ShardingRecord | None = None
    """How each model tensor was sharded over TP ranks and PP stages (format/sharding.py); None: not recorded."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this version does not know, kept so that rewriting a newer file loses nothing."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        object.__setattr__(self, "extra", FrozenDict(self.extra))
        if self.converted_from is not None:
            object.__setattr__(self, "converted_from", FrozenDict(self.converted_from))

    @property
    def is_zero1_full(self) -> bool:
        return bool(self.zero1_full)

    @property
    def expected_manifest_ranks(self) -> list[int] | None:
        """Ranks whose manifest a complete tag has, or None when the metadata does not say."""
        if self.manifest_ranks is not None:
            return list(range(self.manifest_ranks))
        return list(range(self.world_size)) if self.world_size is not None else None

    def with_changes(self, **changes: Any) -> TagMetadata:
        return replace(self, **changes)

    # ------------------------------------------------------------------------------------------ encoding
    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in the order they are written (optional keys only when set)."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "format_version": self.format_version,
            "tag": self.tag,
        }
        if self.created_at is not None:
            out["created_at"] = self.created_at
        if self.tp is not None or self.pp is not None:
            lay: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
            if self.cp is not None:
                lay["cp"] = self.cp
            if self.ep is not None:
                lay["ep"] = self.ep
            lay["world_size"] = self.world_size
            out["layout"] = lay
        out.update(
            {
                "zero1": self.zero1,
                "zero1_dp_size": self.zero1_dp_size,
                "xser": self.xser,
                "items": list(self.items),
                "torch_version": self.torch_version,
            }
        )
        if self.saved_async is not None:
            out["async_save"] = self.saved_async
        if self.zero1_full is not None:
            out["zero1_full"] = self.zero1_full
        if self.converted_from is not None:
            out["converted_from"] = dict(self.converted_from)
        if self.manifest_ranks is not None:
            out["manifest_ranks"] = self.manifest_ranks
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_json()
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    def to_json(self) -> bytes:
        """The file's bytes (stable: pinned by tests/unit/format/test_metadata_and_manifests.py)."""
        return json.dumps(self.to_dict(), indent=1).encode()

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "nxd_ckpt.json") -> TagMetadata:
        """Parse the JSON object; missing keys take defaults (older files), unknown keys go to ``extra``."""
        try:
            if not isinstance(doc, Mapping):
                raise TypeError(f"expected a JSON object, found {type(doc).__name__}")
            if doc.get("format", FORMAT) != FORMAT:
                raise ValueError(f"'format' is {doc.get('format')!r}, not {FORMAT!r}")
            lay = doc.get("layout") or {}
            if not isinstance(lay, Mapping):
                raise TypeError(f"'layout' must be an object, found {type(lay).__name__}")
            items = doc.get("items") or []
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise TypeError("'items' must be a list of names")
            converted = doc.get("converted_from")
            if converted is not None and not isinstance(converted, Mapping):
                raise TypeError("'converted_from' must be an object")
            zero1_full = doc.get("zero1_full")
            saved_async = doc.get("async_save")
            return cls(
                tag=str(doc.get("tag", "")),
                created_at=None if doc.get("created_at") is None else float(doc["created_at"]),
                tp=_opt_int(lay.get("tp")),
                pp=_opt_int(lay.get("pp")),
                dp=_opt_int(lay.get("dp")),
                cp=_opt_int(lay.get("cp")),
                ep=_opt_int(lay.get("ep")),
                world_size=_opt_int(lay.get("world_size")),
                zero1=bool(doc.get("zero1", False)),
                zero1_dp_size=_opt_int(doc.get("zero1_dp_size")),
                xser=bool(doc.get("xser", False)),
                items=tuple(items),
                torch_version=None if doc.get("torch_version") is None else str(doc["torch_version"]),
                format_version=int(doc.get("format_version", FORMAT_VERSION)),
                zero1_full=None if zero1_full is None else bool(zero1_full),
                saved_async=None if saved_async is None else bool(saved_async),
                converted_from=converted,
                manifest_ranks=_opt_int(doc.get("manifest_ranks")),
                sharding=None if doc.get("sharding") is None else ShardingRecord.from_json(doc["sharding"], where),
                extra={k: v for k, v in doc.items() if k not in _KNOWN},
            )
        except (TypeError, ValueError) as e:
            raise FormatError(f"{where} is not valid nxd_ckpt metadata ({e}); it was damaged or edited") from e

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "nxd_ckpt.json") -> TagMetadata:
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise FormatError(f"{where} is not valid JSON: {e}") from e
        return cls.from_dict(doc, where)


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected an integer, found {value!r}")
    return int(value)


def metadata_path(tag: str) -> str:
    return layout.tag_path(tag, layout.METADATA_FILE)


def read_metadata(storage: Any, tag: str) -> TagMetadata | None:
    """The metadata of a tag, or None for tags written by NxD (or unfinished ones); FormatError if damaged."""
    path = metadata_path(tag)
    if not storage.exists(path):
        return None
    return TagMetadata.from_json(storage.read_bytes(path), f"{storage.url}/{path}")


def write_metadata(storage: Any, meta: TagMetadata) -> str:
    """Write ``meta`` as ``<tag>/nxd_ckpt.json``; return its path."""
    path = metadata_path(meta.tag)
    storage.write_bytes(path, meta.to_json())
    return path
