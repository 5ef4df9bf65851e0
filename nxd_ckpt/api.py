"""The public functions, with NeuronX Distributed's signatures written out (so type checkers and IDEs see them):
each call becomes one validated SaveOptions or LoadOptions (``options.py``, which owns what each parameter means;
``tests/unit/test_options.py`` holds the signatures to its fields), run by one process-wide manager."""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING, Any

from nxd_ckpt.format import tags
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.options import LoadOptions, SaveOptions, nxd_arguments, options_from_call
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.storage import storage_for

if TYPE_CHECKING:
    import torch

    from nxd_ckpt.tier.memory import MemoryTier


class _DefaultManager:
    """Holds the process-wide CheckpointManager; ``reset`` drops it (tests, or a new process group)."""

    def __init__(self) -> None:
        self.manager: CheckpointManager | None = None
        self._atexit_registered = False

    def get(self) -> CheckpointManager:
        if self.manager is None:
            self.manager = CheckpointManager()
            if not self._atexit_registered:
                atexit.register(self._finalize_at_exit)
                self._atexit_registered = True
        return self.manager

    def reset(self) -> None:
        if self.manager is not None:
            self.manager.finalize()
        self.manager = None

    def _finalize_at_exit(self) -> None:
        if self.manager is not None:
            self.manager.finalize()


_default = _DefaultManager()


def get_manager() -> CheckpointManager:
    """The manager ``save_checkpoint``/``load_checkpoint`` use."""
    return _default.get()


def reset_manager() -> None:
    """Finish pending saves and forget the process-wide manager (its coordinator, writer and counters)."""
    _default.reset()


@nxd_arguments
def save_checkpoint(
    checkpoint_dir_str: Any,
    tag: str,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: int = 8,
    use_xser: bool = False,
    num_kept_ckpts: int | None = None,
    async_save: bool = False,
    zero1_optimizer: bool = False,
    use_zero1_dcp: bool = False,
    avoid_saving_lower_precision_weights: bool = False,
    *,
    rank_state: Any = None,
    save_rng: bool = False,
    rank_state_mode: str = "per_rank",
    timeout: float | None = None,
    on_save_error: str = "raise",
    memory_tier: MemoryTier | None = None,
    host_memory_budget: int | str | None = None,
    device_snapshot_budget: int | str | None = None,
) -> SaveReport:
    """Save a checkpoint under ``checkpoint_dir_str/tag`` in NxD's layout; every rank must call it.

    The parameters are ``SaveOptions``' fields (``options.py``), ``checkpoint_dir_str`` its ``checkpoint_dir``:
    those up to ``avoid_saving_lower_precision_weights`` are NxD's, in NxD's order, with NxD's meaning
    (``num_kept_ckpts=-1`` keeps every checkpoint). ``use_zero1_dcp`` asks for torch Distributed Checkpoint
    files for ZeRO-1 state: nxd_ckpt writes NxD's per-rank ZeRO-1 files instead (what NxD itself does when DCP
    support is unavailable) and logs a warning. ``avoid_saving_lower_precision_weights`` lets NxD skip the model's
    tensor data when ZeRO-1 state holds master weights; nxd_ckpt always writes the model (a larger checkpoint
    that NxD loads either way). As in NxD the two cannot be combined.

    Model and replicated optimizer states are written by DP rank 0 of each (TP, PP) coordinate, ZeRO-1
    optimizer shards by every rank, scheduler and user content by global rank 0. The tag is complete (``done``)
    once every rank's files are durable. With ``async_save`` the call returns once the state is staged in host
    memory and the files are written in the background.

    ``rank_state`` is this rank's own state (an object with ``state_dict()``/``load_state_dict()`` such as a
    ``StatefulDataLoader``, or with ``save_state_rank()``/``restore_state_rank()``, or a dict of them) and
    ``save_rng`` adds this rank's RNG streams; both go to one file per rank (``rank_state_mode="per_rank"``)
    or are gathered into one file by the master (``"gather"``). See docs/exact-resume.md.

    ``timeout`` is the deadline in seconds of every phase of this save (default ``NXD_CKPT_TIMEOUT_S``, 1800):
    past it every rank raises CheckpointTimeoutError naming the phase and the ranks it waited for.
    ``on_save_error="warn"`` keeps training going when the save fails (logged on every rank, in the
    SaveReport's ``error``, or the next SaveReport's ``earlier_failures`` for async saves); the previous
    complete checkpoint stays the latest. The default ``"raise"`` raises the failure, on every rank.
    ``memory_tier`` (a ``MemoryTier``) keeps the checkpoint in node memory with copies on peer nodes and writes
    ``checkpoint_dir_str`` only every ``durable_every``-th save (docs/memory-tier.md).
    ``host_memory_budget`` (bytes, or a size such as ``"512MiB"``; default ``NXD_CKPT_HOST_MEMORY_BUDGET``, else
    no limit) caps the host memory an async save holds: a larger state is staged and written in pieces while the
    call waits for what does not fit (the SaveReport's ``budget_wait_s``).
    ``device_snapshot_budget`` (bytes, a size such as ``"8GiB"``, ``"auto"`` or 0; default
    ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET``, else ``"auto"``: 90% of the memory training left unused at its peak, 0
    where the runtime reports no peak; agreed by the ranks and kept from save to save: docs/async.md) caps the
    device memory an async save of device state (XLA, CUDA) copies the state into before it returns; that copy
    travels to the host beside training. What does not fit is moved to the host by the call itself (the
    SaveReport's ``device_direct_bytes`` and ``device_direct_s``); 0 takes no device snapshot.

    Returns:
        A SaveReport (bytes, blocked/staging/write time); for async saves ``wait()`` blocks until durable.
    """
    options = options_from_call(SaveOptions, locals())
    return get_manager().save(options)


@nxd_arguments
def load_checkpoint(
    path: Any,
    tag: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    use_zero1_dcp: bool = False,
    *,
    allow_pickle: bool = False,
    rank_state: Any = None,
    skip_rank_state: bool = False,
    device: str | torch.device | None = None,
    verify: bool = True,
    fallback_to_verified: bool = False,
    timeout: float | None = None,
    sharding: Any = None,
    memory_tier: MemoryTier | None = None,
) -> Any:
    """Load ``tag`` (default: the latest complete checkpoint) from ``path`` into the given objects; every rank
    must call it. The parameters are ``LoadOptions``' fields (``options.py``), ``path`` its ``checkpoint_dir``:
    those up to ``use_zero1_dcp`` are NxD's, in NxD's order, the rest keyword-only. ZeRO-1 state is
    read from NxD's per-rank files whatever ``use_zero1_dcp`` says (a checkpoint whose ZeRO-1 state is in DCP
    format is refused with FormatError). An explicitly named ``tag`` without any ``checkpoint``/``done`` marker (NxD's
    ``checkpoint_converter.py`` output, e.g. ``pretrained_weight``) loads with a warning; one with
    ``checkpoint`` but no ``done`` (an interrupted save) is refused.

    Dicts passed as ``model``/``optimizer``/``scheduler`` are filled in place. ``allow_pickle`` opts in to
    files holding arbitrary pickled classes (it runs code from the checkpoint: only for trusted ones).
    ``rank_state`` receives this rank's saved per-rank state; saved RNG streams are restored whenever present.
    A checkpoint saved with another world size or layout raises LayoutMismatchError unless
    ``skip_rank_state=True``, which ignores per-rank state (data loaders and RNG start fresh).
    Tensors land where the target lives: a model or optimizer on ``xla:0`` gets XLA tensors, dict targets get
    CPU tensors unless ``device`` (e.g. ``"xla"``) is given; asking for XLA without torch_xla raises
    DeviceUnavailableError.
    ``verify`` (default on) checks every file read against the checksums recorded when it was written and raises
    IntegrityError naming a damaged file. With ``fallback_to_verified`` and no ``tag``, a latest checkpoint that
    is damaged is skipped (logged as a WARNING) for the newest complete one that verifies.
    ``timeout`` is the deadline in seconds of each step of the load (default ``NXD_CKPT_TIMEOUT_S``, 1800).
    With ``memory_tier`` the newest complete copy across tiers loads: this node's memory, else copies fetched
    from peer nodes, else ``path``; a damaged copy falls back to the next tier (docs/memory-tier.md).
    A checkpoint saved at another TP or PP size is re-sharded on load (each rank reads only the parts of the
    tensors it holds now) from the sharding recorded at save time; for checkpoints without one (NxD's),
    ``sharding`` describes it: name patterns -> partition dim or ``(dim, stride)`` (None: replicated), a model
    whose parameters carry NxD's tensor-parallel attributes, or a ``ShardingRecord``. Tensors that cannot be
    re-sharded raise ReshardError (a LayoutMismatchError) naming them, before anything is loaded.

    Returns:
        The saved user content, or None if none was saved.
    """
    options = options_from_call(LoadOptions, locals())
    return get_manager().load(options)


def prepare_async_save(
    model: Any = None, optimizer: Any = None, *, use_xser: bool = False, device_snapshot_budget: int | str | None = None
) -> int:
    """Make the first ``save_checkpoint(..., async_save=True)`` of this process as cheap as later ones: the host
    buffers it copies into are reserved now and faulted in beside the training loop (a low-priority thread); on
    XLA state the device snapshot is taken once now, so its graph is compiled before the first save (pass
    ``use_xser`` and ``device_snapshot_budget`` as the saves will). Call it once the model and optimizer exist;
    returns the host bytes reserved."""
    return get_manager().prepare_async_save(
        model=model, optimizer=optimizer, use_xser=use_xser, device_snapshot_budget=device_snapshot_budget
    )


def finalize_checkpoint() -> None:
    """Wait for every pending save to be durable and committed; raise if one failed."""
    get_manager().finalize()


def has_checkpoint(checkpoint_dir_str: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_dir_str`` holds at least one complete checkpoint."""
    get_manager().wait_retention()  # deletions queued by this process's last save are applied first
    return tags.latest_tag(storage_for(checkpoint_dir_str)) is not None


def list_checkpoint_tags(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Complete tags, oldest first."""
    get_manager().wait_retention()
    return [t.name for t in tags.list_tags(storage_for(checkpoint_dir))]


def latest_checkpoint_tag(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete tag, or None."""
    get_manager().wait_retention()
    return tags.latest_tag(storage_for(checkpoint_dir))
