"""One description of a saved tag and one list of the files it must hold.

``describe(storage, tag)`` works out a tag's layout (TP, PP, the DP size its optimizer files are for, the kind
of ZeRO-1 state, xser, what was saved) from ``nxd_ckpt.json`` when there is one, else from NxD's file names.
``expected_files(description)`` is the state files that layout needs. The loader, ``inspect``/``list``,
``verify`` (Python and CLI) and ``convert-zero1`` all ask these two, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from nxd_ckpt.format import layout
from nxd_ckpt.format.metadata import TagMetadata, read_metadata
from nxd_ckpt.storage import Storage

ITEMS = ("model", "optimizer", "scheduler", "user_content")

ZERO1_NONE = "none"
ZERO1_SHARDED = "sharded"
ZERO1_FULL = "full"


@dataclass(frozen=True)
class TagDescription:
    """How one tag was saved; ``None`` where neither the metadata nor the file names tell."""

    tag: str
    tp: int | None
    pp: int | None
    dp: int | None
    """DP size the optimizer files are laid out for: the ZeRO-1 shard count, else the saving job's DP size
    (recorded in the metadata), None for merged (full) ZeRO-1 files, which load at any DP size."""
    world_size: int | None
    zero1: bool
    zero1_dp_size: int | None
    """DP size of the ZeRO-1 shards on storage (None: not ZeRO-1, or merged into full files)."""
    zero1_full: bool
    """The ZeRO-1 state is merged into ``optim/full_tp_rank_XX_pp_rank_YY.pt`` files (convert-zero1)."""
    xser: bool
    items: tuple[str, ...] | None
    """What the metadata says was saved (None for tags without metadata)."""
    present_items: tuple[str, ...]
    """What the state files on storage hold (model, optimizer, scheduler, user_content)."""
    metadata: TagMetadata | None
    ep: int = 1
    """Expert-parallel size: above 1, model (and replicated optimizer) files carry ``_ep_rank_XX``."""

    @property
    def zero1_kind(self) -> str:
        """``"none"``, ``"sharded"`` or ``"full"``."""
        return ZERO1_FULL if self.zero1_full else ZERO1_SHARDED if self.zero1 else ZERO1_NONE

    @property
    def saved_items(self) -> tuple[str, ...]:
        """The items the tag must hold: recorded ones, else the ones present."""
        return self.items if self.items is not None else self.present_items

    def text(self) -> str:
        """``DP=4 TP=2 PP=1, ZeRO-1, xser``: the one-line layout every tool prints."""
        return layout_text(self.dp, self.tp, self.pp, self.zero1, self.zero1_full, self.xser, self.ep)


def layout_text(
    dp: int | None, tp: int | None, pp: int | None, zero1: bool, zero1_full: bool, xser: bool, ep: int = 1
) -> str:
    """The one-line layout (``DP=4 TP=2 PP=1, ZeRO-1, xser``; ``DP=any …, ZeRO-1 (full)`` for merged files)."""

    def size(v: int | None) -> str:
        return "?" if v is None else str(v)

    out = f"DP={'any' if zero1_full else size(dp)} TP={size(tp)} PP={size(pp)}" + (f" EP={ep}" if ep > 1 else "")
    if zero1_full:
        out += ", ZeRO-1 (full)"
    elif zero1:
        out += ", ZeRO-1"
    return out + (", xser" if xser else "")


_UNREAD = object()


def describe(storage: Storage, tag: str, metadata: TagMetadata | object | None = _UNREAD) -> TagDescription:
    """The layout of ``tag``; ``metadata`` when the caller has read (or failed to read) it already.

    Raises FormatError when ``nxd_ckpt.json`` exists but cannot be read (unless ``metadata`` is given).
    """
    meta: TagMetadata | None = read_metadata(storage, tag) if metadata is _UNREAD else metadata  # type: ignore[assignment]
    model_names = storage.list_dir(layout.tag_path(tag, layout.MODEL_DIR))
    optim_names = storage.list_dir(layout.tag_path(tag, layout.OPTIM_DIR))
    model = [c for n in model_names if (c := layout.parse_state_file_name(n))]
    shards = [c for n in optim_names if (c := layout.parse_state_file_name(n))]
    fulls = [c for n in optim_names if (c := layout.parse_full_optim_file_name(n))]
    tp, pp = _model_parallel_sizes(meta, model + shards, fulls)
    zero1, zero1_full, zero1_dp_size, dp = _zero1_facts(meta, shards, fulls)
    if meta is not None and meta.ep is not None:
        ep = meta.ep
    else:
        eps = [e for n in model_names + optim_names if (e := layout.parse_expert_rank(n)) is not None]
        ep = max(eps) + 1 if eps else 1
    suffix = layout.XSER_TENSORS_SUFFIX
    xser = (meta is not None and meta.xser) or any(n.endswith(suffix) for n in model_names + optim_names)
    return TagDescription(
        tag=tag,
        tp=tp,
        pp=pp,
        dp=dp,
        world_size=meta.world_size if meta is not None else None,
        zero1=zero1,
        zero1_dp_size=zero1_dp_size,
        zero1_full=zero1_full,
        xser=xser,
        items=meta.items if meta is not None else None,
        present_items=_present_items(storage, tag, bool(model), bool(shards or fulls)),
        metadata=meta,
        ep=ep,
    )


def _model_parallel_sizes(
    meta: TagMetadata | None, state_files: list[tuple[int, ...]], fulls: list[tuple[int, ...]]
) -> tuple[int | None, int | None]:
    """TP and PP sizes: recorded, else one more than the highest ranks in the file names."""
    if meta is not None and meta.tp is not None and meta.pp is not None:
        return meta.tp, meta.pp
    tps = [c[1] for c in state_files] + [c[0] for c in fulls]
    pps = [c[2] for c in state_files] + [c[1] for c in fulls]
    return (max(tps) + 1 if tps else None), (max(pps) + 1 if pps else None)


def _zero1_facts(
    meta: TagMetadata | None, shards: list[tuple[int, ...]], fulls: list[tuple[int, ...]]
) -> tuple[bool, bool, int | None, int | None]:
    """(zero1, zero1_full, zero1_dp_size, dp): recorded, else read off the optimizer file names."""
    recorded_full = meta.zero1_full if meta is not None else None
    zero1_full = recorded_full if recorded_full is not None else bool(fulls) and not shards
    # without metadata, a single dp_rank_00 shard looks like a replicated optimizer (they are the same file)
    zero1 = zero1_full or (meta.zero1 if meta is not None else any(c[0] > 0 for c in shards))
    zero1_dp_size: int | None = None
    if zero1 and not zero1_full:
        if meta is not None and meta.zero1_dp_size is not None:
            zero1_dp_size = meta.zero1_dp_size
        elif shards:
            zero1_dp_size = max(c[0] for c in shards) + 1
    if zero1_full:
        dp = None
    elif zero1_dp_size is not None:
        dp = zero1_dp_size
    else:
        dp = meta.dp if meta is not None else None
    return zero1, zero1_full, zero1_dp_size, dp


def _present_items(storage: Storage, tag: str, has_model: bool, has_optimizer: bool) -> tuple[str, ...]:
    """The kinds of state whose files the tag holds."""
    top = set(storage.list_dir(layout.validate_tag(tag)))
    present = [name for name, here in (("model", has_model), ("optimizer", has_optimizer)) if here]
    files = (("scheduler", layout.SCHEDULER_FILE), ("user_content", layout.USER_CONTENT_FILE))
    present += [name for name, file in files if file in top]
    return tuple(present)


def expected_files(desc: TagDescription) -> list[str]:
    """State files (paths relative to the tag) the tag must hold: every (TP, PP[, EP]) coordinate of its grid for
    the model and a replicated optimizer, every DP shard for ZeRO-1 (or the full files), the master's files.
    ZeRO-1 shard names carry no EP rank (NxD's naming): their DP rank already tells them apart."""
    items = desc.saved_items
    out: list[str] = []
    if desc.tp is not None and desc.pp is not None:
        grid = [(tp, pp) for pp in range(desc.pp) for tp in range(desc.tp)]
        eps: list[int | None] = list(range(desc.ep)) if desc.ep > 1 else [None]
        if "model" in items:
            out += [f"{layout.MODEL_DIR}/{layout.state_file_name(0, tp, pp, ep)}" for tp, pp in grid for ep in eps]
        if "optimizer" in items:
            if desc.zero1_full:
                out += [_rel(desc.tag, layout.full_optim_file(desc.tag, tp, pp)) for tp, pp in grid]
            elif desc.zero1:
                dps = range(desc.zero1_dp_size or 1)
                out += [f"{layout.OPTIM_DIR}/{layout.state_file_name(dp, tp, pp)}" for dp in dps for tp, pp in grid]
            else:
                out += [f"{layout.OPTIM_DIR}/{layout.state_file_name(0, tp, pp, ep)}" for tp, pp in grid for ep in eps]
    if "scheduler" in items:
        out.append(layout.SCHEDULER_FILE)
    if "user_content" in items:
        out.append(layout.USER_CONTENT_FILE)
    return out


def _rel(tag: str, path: str) -> str:
    return path[len(tag) + 1 :]
