"""What one save or load was asked to do: NxD's parameters and ours, validated once, carried as one frozen value.

``api.save_checkpoint``/``load_checkpoint`` (NxD's signatures) build a ``SaveOptions``/``LoadOptions``; the
manager, the pipelines (``save/pipeline.py``, ``load/pipeline.py``), the memory tier and the framework entry
points pass that value on. A new option is a field here, validated in ``__post_init__``, and read where it is
used; nothing in between repeats it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch

from nxd_ckpt import knobs
from nxd_ckpt.device.backend import SnapshotBudget, resolve_snapshot_budget
from nxd_ckpt.format import layout
from nxd_ckpt.format.retention import KeepLatest
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.tier.memory import MemoryTier

logger = logging.getLogger("nxd_ckpt")

SAVE_ERROR_POLICIES = ("raise", "warn")
"""``on_save_error``: raise a failed save on every rank, or log it and keep training."""

_Options = TypeVar("_Options", "SaveOptions", "LoadOptions")
_Result = TypeVar("_Result")
_Params = ParamSpec("_Params")

RANK_STATE_MODES = ("per_rank", "gather")
"""``rank_state_mode``: one file per rank, or every rank's state gathered into one file by the master."""

SAVE_ITEMS = ("model", "optimizer", "scheduler", "user_content")
"""The state NxD's ``save_checkpoint`` takes, in the order it is listed in a tag's metadata."""


@dataclass(frozen=True)
class SaveOptions:
    """One ``save_checkpoint`` call. Fields up to ``avoid_saving_lower_precision_weights`` are NxD's parameters
    (``checkpoint_dir_str`` is ``checkpoint_dir``), with NxD's defaults; the rest are nxd_ckpt's keywords
    (see ``api.save_checkpoint``)."""

    checkpoint_dir: Any
    """A directory path, an ``s3://`` URL, or a Storage."""
    tag: str
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    user_content: Any = None
    num_workers: int = 8
    use_xser: bool = False
    num_kept_ckpts: int | None = None
    async_save: bool = False
    zero1_optimizer: bool = False
    use_zero1_dcp: bool = False
    avoid_saving_lower_precision_weights: bool = False
    _: KW_ONLY
    """NxD's parameters above (positional, in NxD's order), nxd_ckpt's below (keyword-only)."""
    rank_state: Any = None
    save_rng: bool = False
    rank_state_mode: str = "per_rank"
    timeout: float | None = None
    on_save_error: str = "raise"
    memory_tier: MemoryTier | None = None
    host_memory_budget: int | str | None = None
    device_snapshot_budget: int | str | None = None
    timeout_s: float = field(init=False, repr=False)
    """``timeout``, or ``NXD_CKPT_TIMEOUT_S`` when None: the deadline of every phase of this save."""
    budget_bytes: int | None = field(init=False, repr=False)
    """``host_memory_budget`` in bytes, or ``NXD_CKPT_HOST_MEMORY_BUDGET`` when None; None: no limit."""
    device_budget: SnapshotBudget = field(init=False, repr=False)
    """``device_snapshot_budget``, or ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET`` when None (``auto``: docs/async.md)."""
    retention: KeepLatest | None = field(init=False, repr=False)
    """What ``num_kept_ckpts`` keeps once this save is committed; None (``num_kept_ckpts`` None or -1): no retention."""

    def __post_init__(self) -> None:
        layout.validate_tag(self.tag)
        if self.on_save_error not in SAVE_ERROR_POLICIES:
            raise ValueError(f"on_save_error must be 'raise' or 'warn', got {self.on_save_error!r}")
        retention = KeepLatest(self.num_kept_ckpts)  # validates num_kept_ckpts
        _check_workers(self.num_workers)
        if self.rank_state_mode not in RANK_STATE_MODES:
            modes = ", ".join(map(repr, RANK_STATE_MODES))
            raise ValueError(f"rank_state_mode must be one of {modes}, got {self.rank_state_mode!r}")
        _check_tier(self.memory_tier)
        _check_zero1_dcp(self.use_zero1_dcp, self.avoid_saving_lower_precision_weights)
        object.__setattr__(self, "timeout_s", resolve_timeout(self.timeout))
        object.__setattr__(self, "budget_bytes", resolve_budget(self.host_memory_budget))
        object.__setattr__(self, "device_budget", resolve_snapshot_budget(self.device_snapshot_budget))
        object.__setattr__(self, "retention", None if retention.keeps_all else retention)

    @property
    def items(self) -> tuple[str, ...]:
        """The kinds of state this save holds (recorded in the tag's metadata)."""
        return tuple(name for name in SAVE_ITEMS if getattr(self, name) is not None)

    def replace(self, **changes: Any) -> SaveOptions:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LoadOptions:
    """One ``load_checkpoint`` call. Fields up to ``use_zero1_dcp`` are NxD's parameters (``path`` is
    ``checkpoint_dir``), with NxD's defaults; the rest are nxd_ckpt's keywords (see ``api.load_checkpoint``)."""

    checkpoint_dir: Any
    """A directory path, an ``s3://`` URL, or a Storage (a memory-tier view included)."""
    tag: str | None = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    num_workers: int = 8
    strict: bool = True
    use_zero1_dcp: bool = False
    """Accepted for NxD's signature: ZeRO-1 state is read from NxD's per-rank files whatever it says."""
    _: KW_ONLY
    """NxD's parameters above (positional, in NxD's order), nxd_ckpt's below (keyword-only)."""
    allow_pickle: bool = False
    rank_state: Any = None
    skip_rank_state: bool = False
    device: str | torch.device | None = None
    verify: bool = True
    fallback_to_verified: bool = False
    timeout: float | None = None
    sharding: Any = None
    memory_tier: MemoryTier | None = None
    timeout_s: float = field(init=False, repr=False)
    """``timeout``, or ``NXD_CKPT_TIMEOUT_S`` when None: the deadline of each step of this load."""

    def __post_init__(self) -> None:
        _check_workers(self.num_workers)
        _check_tier(self.memory_tier)
        object.__setattr__(self, "timeout_s", resolve_timeout(self.timeout))

    def replace(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def nxd_arguments(fn: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """``fn`` (``api``'s written-out signature, which type checkers see) with its argument errors worded for NxD
    users: an unknown keyword is named with the accepted ones, a positional argument past NxD's says nxd_ckpt's
    options are keyword-only. ``tests/unit/test_options.py`` holds the signature to ``cls``'s fields."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        _check_arguments(signature, fn.__name__, args, kwargs)
        return fn(*args, **kwargs)

    return checked


def options_from_call(cls: type[_Options], arguments: dict[str, Any]) -> _Options:
    """``cls`` from one call of ``api``'s function, whose parameters are ``cls``'s fields (``locals()`` on entry):
    the first is the directory, whatever NxD names it (``checkpoint_dir_str``, ``path``); validated once, here."""
    (_, checkpoint_dir), *rest = arguments.items()
    return cls(checkpoint_dir, **dict(rest))


def _check_arguments(
    signature: inspect.Signature, function: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise TypeError, worded as Python's, for arguments ``signature`` does not take (what to pass instead)."""
    unknown = [name for name in kwargs if name not in signature.parameters]
    if unknown:
        raise TypeError(
            f"{function}() got an unexpected keyword argument {unknown[0]!r}; the accepted ones are "
            + ", ".join(signature.parameters)
        )
    positional = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if len(args) > len(positional):
        required = sum(p.default is inspect.Parameter.empty for p in positional)
        raise TypeError(
            f"{function}() takes from {required} to {len(positional)} positional arguments (NxD's) but {len(args)} "
            "were given; nxd_ckpt's own options are keyword-only"
        )
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:  # a missing or repeated argument
        raise TypeError(f"{function}() {'got ' if str(e).startswith('multiple') else ''}{e}") from None


def save_options(checkpoint_dir: str | os.PathLike[str] | Any, tag: str | None = None, **keywords: Any) -> SaveOptions:
    """``checkpoint_dir`` if it already is a SaveOptions (then nothing else may be given), else one built from
    the arguments: the manager's ``save`` accepts either."""
    if tag is None and not isinstance(checkpoint_dir, SaveOptions):
        raise TypeError("save needs a tag (the name of the checkpoint's directory, e.g. 'step_100')")
    return _given_or_built(SaveOptions, checkpoint_dir, tag, keywords)


def load_options(checkpoint_dir: str | os.PathLike[str] | Any, tag: str | None = None, **keywords: Any) -> LoadOptions:
    """``checkpoint_dir`` if it already is a LoadOptions (then nothing else may be given), else one built from
    the arguments: the manager's ``load`` accepts either."""
    return _given_or_built(LoadOptions, checkpoint_dir, tag, keywords)


def _given_or_built(cls: type[_Options], first: Any, tag: str | None, keywords: dict[str, Any]) -> _Options:
    if not isinstance(first, cls):
        return cls(first, tag, **keywords)
    if tag is not None or keywords:
        action = "save" if cls is SaveOptions else "load"
        raise TypeError(f"pass either a {cls.__name__} or the {action}'s arguments, not both")
    return first


def _check_workers(num_workers: Any) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")


def _check_tier(memory_tier: Any) -> None:
    if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
        raise TypeError(f"memory_tier must be a nxd_ckpt.MemoryTier, got {type(memory_tier).__name__}")


_warned_dcp = False


def _check_zero1_dcp(use_zero1_dcp: bool, avoid_saving_lower_precision_weights: bool) -> None:
    """NxD's two ZeRO-1 save options: refused together (as NxD does); DCP is not written (one warning)."""
    global _warned_dcp
    if use_zero1_dcp and avoid_saving_lower_precision_weights:
        raise ValueError(
            "use_zero1_dcp and avoid_saving_lower_precision_weights cannot be combined (NxD refuses it too); "
            "pass at most one of them"
        )
    if use_zero1_dcp and not _warned_dcp:
        _warned_dcp = True
        logger.warning(
            "use_zero1_dcp=True: nxd_ckpt writes ZeRO-1 optimizer state as NxD's per-rank files "
            "(optim/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt), not torch Distributed Checkpoint files"
        )


def resolve_budget(value: int | str | None) -> int | None:
    """The budget of one save in bytes: ``value`` (an integer or a size such as ``"512MiB"``), else
    ``NXD_CKPT_HOST_MEMORY_BUDGET``, else None (no limit)."""
    if value is None:
        return knobs.host_memory_budget()
    if isinstance(value, str):
        parsed = knobs.parse_size(value)
        if parsed is None:
            raise ValueError(
                f"host_memory_budget={value!r} is not a size; use bytes (an integer > 0) or a size such as '512MiB', "
                "'2GiB' or '1.5GB'"
            )
        return parsed
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"host_memory_budget must be None, bytes (an integer > 0) or a size string, got {value!r}")
    return value
