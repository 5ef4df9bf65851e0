"""``CheckpointManager``: TorchTitan's checkpoint manager writing and reading through ``nxd_ckpt.dcp``.

It does what TorchTitan 0.3.0's DCP manager (``torchtitan.components.checkpointer.CheckpointManager``) does, with
the same config fields, keyword arguments and ``step-N`` folders, so either manager resumes the other's
checkpoints. What it changes: every save goes through ``nxd_ckpt.dcp.StorageWriter`` (checksums, a crash-safe
commit, deadlines, ``s3://``), every load through ``nxd_ckpt.dcp.StorageReader`` (verified: a damaged step raises
IntegrityError naming the file, or with ``fallback_to_verified`` the newest intact step loads instead), and
``keep_latest_k`` goes through the library's retention policy. docs/torchtitan.md lists every difference.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.dcp.place import METADATA
from nxd_ckpt.errors import FormatError, IntegrityError
from nxd_ckpt.ranks.coordinator import Coordinator, new_gloo_group, world_rank
from nxd_ckpt.storage import storage_for
from nxd_ckpt.storage.base import is_not_found
from nxd_ckpt.tier.memory import MemoryTier
from nxd_ckpt.tier.shared import close_runtimes, shared_tier
from nxd_ckpt.tools.hf_folder import expected_of
from nxd_ckpt.torchtitan import hf
from nxd_ckpt.torchtitan.staging import ASYNC_MODES, check_budgets, make_stager, wait_for_staging
from nxd_ckpt.torchtitan.steps import StepFolders, parse_step

logger = logging.getLogger("nxd_ckpt")

_DAMAGE = (FormatError, FileNotFoundError)
"""What the reader raises for a damaged checkpoint (IntegrityError is a FormatError) or a file of it gone."""
RECHECK_PAUSES_S = (0.5, 1.0, 2.0)
"""Pauses before each new look at a step whose file was missing (a shared file system may show a file late):
it counts as damaged only if the file is still missing after them all (3.5 s)."""


class CheckpointManager(BaseCheckpointManager):
    """TorchTitan's checkpoint manager over ``nxd_ckpt.dcp`` (select it with ``checkpoint=CheckpointManager.Config(
    ...)`` in the job config; TorchTitan's trainer builds it with the keyword arguments of its own DCP manager)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """TorchTitan's checkpoint fields and its DCP manager's ``async_mode``, plus nxd_ckpt's below."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Synchronous saves, or async saves (both async values stage through ``nxd_ckpt.dcp.Stager``)."""

        fallback_to_verified: bool = False
        """Resuming from the newest step: when it is damaged, load the newest intact one (with a warning)."""

        files_per_rank: int = 1
        """``.distcp`` files (and writer threads) per rank."""

        timeout_s: float | None = None
        """Deadline of each storage phase of a save, in seconds (None: ``NXD_CKPT_TIMEOUT_S``)."""

        host_memory_budget: int | str | None = None
        """Host memory the staged copies of async saves may hold (bytes or a size; None:
        ``NXD_CKPT_HOST_MEMORY_BUDGET``, else no limit)."""

        device_snapshot_budget: int | str | None = None
        """Device memory for the snapshot of device state (bytes, a size or ``"auto"``; None:
        ``NXD_CKPT_DEVICE_SNAPSHOT_BUDGET``)."""

        memory_tier: MemoryTier | None = None
        """Save to node memory and peer nodes' memory, to ``folder`` every ``durable_every``-th save (the last
        step always); loads take the newest complete copy across the tiers."""

        def __post_init__(self) -> None:
            # TorchTitan refuses last_save_in_hf with a remote folder (its HF writer is local only); ours writes
            # s3:// as every other save, so its check runs without the flag and the rest of it is repeated here
            in_hf, self.last_save_in_hf = self.last_save_in_hf, False
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf = in_hf
            if in_hf and not self.last_save_model_only:
                raise ValueError("last_save_in_hf requires last_save_model_only=True.")
            if in_hf and "://" in self.folder and not self.folder.startswith("s3://"):
                raise ValueError(f"last_save_in_hf writes a local folder or s3://, not {self.folder}")
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode!r}; use one of {', '.join(ASYNC_MODES)}")
            if isinstance(self.files_per_rank, bool) or not isinstance(self.files_per_rank, int):
                raise ValueError(f"checkpoint.files_per_rank must be an int >= 1, got {self.files_per_rank!r}")
            if self.files_per_rank < 1:
                raise ValueError(f"checkpoint.files_per_rank must be an int >= 1, got {self.files_per_rank!r}")
            check_budgets(self.host_memory_budget, self.device_snapshot_budget)
            if self.memory_tier is not None and not isinstance(self.memory_tier, MemoryTier):
                raise ValueError(
                    f"checkpoint.memory_tier must be a nxd_ckpt.MemoryTier, got {type(self.memory_tier).__name__}"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        """The arguments of TorchTitan's DCP manager: ``states`` (e.g. ``{"train_state": trainer}``) is updated
        in place with the model, optimizer, dataloader and LR-scheduler entries, as TorchTitan's manager does."""
        self.enable = config.enable
        self.save_future: Future | None = None
        self.staging_future: Future | None = None
        self._closed = False
        self.last_reader: StorageReader | None = None
        """The reader of the last load (its ``tier_view``: where it read from)."""
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.steps = StepFolders.of(self.folder)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError(
                "checkpoint.last_save_in_hf is True, but sd_adapter is not provided: the model's state-dict adapter "
                "names the Hugging Face tensors"
            )
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.async_mode = config.async_mode
        self.pg = new_gloo_group() if self.async_mode != "disabled" else None
        self.stager = make_stager(
            self.async_mode, config.host_memory_budget, config.device_snapshot_budget, config.timeout_s
        )
        keeps = config.keep_latest_k > 0 and world_rank() == 0
        self._purger = ThreadPoolExecutor(1, thread_name_prefix="nxd_titan_purge") if keeps else None
        self._purges: list[Future] = []
        logger.info("nxd_ckpt TorchTitan checkpointing active: checkpoints load from and save to %s", self.folder)

    # ------------------------------------------------------------------------------------------------ saving
    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when the policy says so (interval, first step, last step); True when saved or
        started (async)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
        elif self.async_mode == "disabled":
            dcp.save(self._flattened(self.states), storage_writer=self._writer(curr_step))
            self._purge()
        else:
            self._save_async(curr_step)
        logger.info(
            "checkpoint step-%d %s in %.2f s",
            curr_step,
            "saved" if last_step or self.save_future is None else "staged",
            time.monotonic() - begin,
        )
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """TorchTitan's policy: never with ``load_only``; at step 1 with ``enable_first_step_checkpoint``; at the
        last step; every ``interval`` steps."""
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _writer(self, step: int, durable: bool = False) -> StorageWriter:
        """The library's DCP writer for ``step``'s folder (one per save: DCP resets it per checkpoint), through
        the memory tier if there is one (not for a ``durable`` save: the last step)."""
        return StorageWriter(
            self.steps.path(step),
            thread_count=self.config.files_per_rank,
            timeout=self.config.timeout_s,
            memory_tier=None if durable else self.config.memory_tier,
        )

    def _save_async(self, curr_step: int) -> None:
        """Start an async save through ``nxd_ckpt.dcp.Stager``: returns once the state is snapshotted (training may
        change it at once); ``maybe_wait_for_staging`` waits for the host copies, the write runs on a thread."""
        result = dcp.async_save(
            self._flattened(self.states),
            storage_writer=self._writer(curr_step),
            process_group=self.pg,
            async_stager=self.stager,
        )
        if isinstance(result, AsyncSaveResponse):
            self.staging_future = result.staging_completion
            self.save_future = result.upload_completion
        else:
            self.save_future = result

    def _save_last_step(self, curr_step: int) -> None:
        """The last step, synchronously: model only in ``export_dtype`` (``last_save_model_only``) or everything;
        with ``last_save_in_hf`` the model only, through the adapter, as a Hugging Face safetensors set."""
        if self.config.last_save_model_only:
            states = {
                k: v.to(self.export_dtype)
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
                else v
                for k, v in self.states[MODEL].state_dict().items()
            }
            logger.info("saving a model-only checkpoint in %s at the last step, step %d", self.export_dtype, curr_step)
        else:
            states = self._flattened(self.states)
        if self.config.last_save_in_hf:  # export_dtype applied before to_hf, as TorchTitan does
            path = self.steps.path(curr_step)
            hf.save_hf(self.sd_adapter.to_hf(states), path, hf.fqn_to_index_of(self.sd_adapter), self.config.timeout_s)
            logger.info("saved step-%d in Hugging Face safetensors format at %s", curr_step, path)
            return
        dcp.save(states, storage_writer=self._writer(curr_step, durable=True))

    def _purge(self) -> None:
        """Rank 0: retention (``keep_latest_k``) on a background thread, once a save is committed."""
        if self._purger is None:
            return
        self._purges = [f for f in self._purges if not f.done() or _log_purge_error(f)]
        self._purges.append(self._purger.submit(self.steps.apply_retention, self.config.keep_latest_k))

    # --------------------------------------------------------------------------------------------- waiting
    def _maybe_wait_for_staging(self) -> None:
        """Wait until the last async save's staging is done (training may then change the state)."""
        future, self.staging_future = self.staging_future, None
        if future is not None:
            wait_for_staging(future, self.config.timeout_s, world_rank())

    def _wait_for_saving(self) -> None:
        """Wait until the last async save is committed (its error raised here, once), then run retention."""
        future, self.save_future = self.save_future, None
        self.staging_future = None
        assert future is not None  # BaseCheckpointManager calls this only when a save is in flight
        future.result()
        self._purge()

    def _close(self) -> None:
        """Wait for the save in flight (its error is raised), then stop the stager and the retention thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self.maybe_wait_for_saving()
        finally:
            if self.stager is not None:
                self.stager.close()
            if self._purger is not None:
                self._purger.shutdown(wait=True)
                for future in self._purges:
                    _log_purge_error(future)
            if self.config.memory_tier is not None:
                close_runtimes(self.steps.storage.url)

    # ------------------------------------------------------------------------------------------------ loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest complete one; none there: the initial checkpoint, if any). True when a
        checkpoint was loaded."""
        has_folder, complete = Coordinator(timeout_s=self.config.timeout_s).master_computes(
            self._list_steps, "listing the checkpoint steps"
        )
        in_memory = self._newest_in_memory()
        if in_memory is not None:
            has_folder, complete = True, sorted({*complete, in_memory})
        if step != -1:
            if not has_folder:
                raise FileNotFoundError(
                    f"--checkpoint.load_step={step} not found because checkpoint.folder {self.folder} does not exist"
                )
            if step not in complete:
                raise FileNotFoundError(
                    f"--checkpoint.load_step={step} not found at {self.steps.path(step)} (no complete checkpoint: "
                    f"no {METADATA}); complete steps there: {complete or 'none'}"
                )
            self._load_step(step)
            return True
        if complete:
            self._load_newest(complete)
            return True
        return self._initial_load()

    def _list_steps(self) -> tuple[bool, list[int]]:
        """Rank 0 (every rank receives it): whether the checkpoint folder exists and its complete steps, after a
        step a save killed between its two renames got its checkpoint back (``StepFolders.repair``)."""
        if not self.steps.exists():
            return False, []
        self.steps.repair()  # each repair is logged
        return True, self.steps.complete_steps()

    def _newest_in_memory(self) -> int | None:
        """(Collective.) The newest step the memory tier holds a complete copy of, None without a tier or copy."""
        if self.config.memory_tier is None:
            return None
        tier = shared_tier(self.config.memory_tier, self.steps.storage.url, self.config.timeout_s)
        choice, _ = tier.newest()
        return parse_step(choice.tag) if choice is not None else None

    def _load_newest(self, complete: list[int]) -> None:
        """The newest complete step; with ``fallback_to_verified`` a damaged one is skipped (a warning) for the
        next newest, down to the oldest."""
        damaged = []
        for step in reversed(complete):
            try:
                self._load_step(step)
                if damaged:
                    logger.warning("loaded step-%d, the newest intact checkpoint in %s", step, self.folder)
                return
            except IntegrityError as e:
                if not self.config.fallback_to_verified:
                    raise
                logger.warning("skipping damaged checkpoint step-%d (fallback_to_verified): %s", step, e)
                damaged.append(step)
        raise IntegrityError(
            f"every checkpoint in {self.folder} is damaged (steps {damaged}); restore one from a copy or start "
            "without checkpoint.folder's contents"
        )

    def _load_step(self, step: int) -> None:
        """One step of this folder, verified; model only for step 0 (a seed checkpoint), as TorchTitan does."""
        logger.info("loading the checkpoint %s", self.steps.path(step))
        self._verified_load(self._states_to_load(model_only=step == 0), self.steps.path(step), self.config.memory_tier)

    def _initial_load(self) -> bool:
        """No checkpoint in the folder: ``initial_load_path`` (model only unless ``initial_load_model_only`` is
        False), or Hugging Face weights (``initial_load_in_hf``); False for a fresh start."""
        path = self.config.initial_load_path
        if self.config.initial_load_in_hf:
            self._load_hf(path or self._hf_assets_path())
            return True
        if not path:
            logger.info("no checkpoint was provided, this is a fresh start")
            return False
        if not storage_for(path).exists(METADATA):
            raise ValueError(f"checkpoint.initial_load_path is invalid: {path} holds no DCP checkpoint ({METADATA})")
        logger.info("loading the initial checkpoint %s", path)
        self._verified_load(self._states_to_load(model_only=self.config.initial_load_model_only), path)
        return True

    def _verified_load(self, states: dict[str, Any], path: str, memory_tier: MemoryTier | None = None) -> None:
        """``dcp.load`` through ``nxd_ckpt.dcp.StorageReader`` (from the memory tier's copy where it holds one);
        a damaged checkpoint raises IntegrityError naming what is wrong, on every rank (DCP gathers each rank's
        failure)."""
        for pause in (*RECHECK_PAUSES_S, None):
            try:
                reader = StorageReader(path, memory_tier=memory_tier, timeout=self.config.timeout_s)
                self.last_reader = reader
                dcp.load(states, storage_reader=reader)
                break
            except (Exception, CheckpointException) as e:
                damage = _damage(e)
                if damage is None:
                    raise
                if pause is not None and is_not_found(damage):  # every rank decides alike: DCP gathered the errors
                    logger.warning("checkpoint %s: a file is missing (%s); looking again in %g s", path, damage, pause)
                    time.sleep(pause)
                    continue
                fallback = self.config.fallback_to_verified
                hint = "" if fallback else " (fallback_to_verified=True loads the newest intact)"
                raise IntegrityError(f"checkpoint {path} is damaged: {damage}{hint}") from e
        self.states[MODEL].load_state_dict(states)  # the model's entries are flattened into ``states``

    def _load_hf(self, path: str) -> None:
        """Hugging Face safetensors through the model's state-dict adapter and its reader, as TorchTitan's manager
        reads them, once rank 0 has checked the folder (``tools.hf_folder.check_folder``: the manifests of a folder the
        library wrote, every header and byte range, each tensor against the model); the model changes only then."""
        if self.sd_adapter is None:
            raise ValueError("checkpoint.initial_load_in_hf needs the model's state-dict adapter (sd_adapter)")
        quantized = self.config.initial_load_in_hf_quantized
        hf_state = self.sd_adapter.to_hf(self.states[MODEL].state_dict())
        hf.check_hf_folder_on_all_ranks(path, None if quantized else expected_of(hf_state), self.config.timeout_s)
        logger.info("loading Hugging Face weights from %s (checked)", path)
        dcp.load(hf_state, storage_reader=self.sd_adapter.get_hf_storage_reader(path, quantized))
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state))

    def _hf_assets_path(self) -> str:
        """Where the model's Hugging Face weights are (``model.hf_assets_path``, through the adapter)."""
        path = getattr(self.sd_adapter, "hf_assets_path", None)
        if not path:
            raise ValueError(
                "checkpoint.initial_load_in_hf without checkpoint.initial_load_path needs model.hf_assets_path"
            )
        return str(path)

    # ------------------------------------------------------------------------------------------------ states
    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        """The model's flattened entries alone, or every state but ``exclude_from_loading``'s."""
        if model_only:
            return self.states[MODEL].state_dict()
        for key in self.config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading names {key!r}, which is not a saved state")
        return self._flattened({k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading})

    @staticmethod
    def _flattened(states: dict[str, Any]) -> dict[str, Any]:
        """TorchTitan's layout: the model's entries at the top level beside the other states."""
        flat = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat


def _damage(error: BaseException) -> BaseException | None:
    """The reader's damage report behind ``error`` (DCP wraps each rank's failure in CheckpointException): damaged
    bytes first, else a missing file (which the caller looks at again before it counts as damage); None when the
    failure is something else (a missing key, a shape mismatch, a process-group error). The same on every rank
    for the same CheckpointException."""
    pending, seen, missing = [error], set(), None
    while pending:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if is_not_found(e):
            missing = missing or e
        elif isinstance(e, _DAMAGE):
            return e
        if isinstance(e, CheckpointException):
            pending.extend(e.failures[rank][0] for rank in sorted(e.failures))
        pending.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return missing


def _log_purge_error(future: Future) -> bool:
    """Log a retention run's failure (retention never stops training); False, so a filter drops the future."""
    error = future.exception()
    if error is not None:
        logger.warning("checkpoint retention failed: %s", error)
    return False
