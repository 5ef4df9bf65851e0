"""Executing a read plan (``load.read_plan.ReadPlan``) on this rank: its files read into the live model,
optimizer and scheduler, the user content returned.

``prepare_reshard`` first plans the parts of a re-sharded load on every rank (one cross-rank step, before
anything is read); ``PlanRead.apply`` then reads, the optimizer's files on a thread of their own while the
model's are read where no collective is involved. A missing file is a FormatError that says why
(``missing_file_error``).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import torch

from nxd_ckpt import adapters, statefile
from nxd_ckpt.errors import FormatError, LayoutMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.format.describe import TagDescription
from nxd_ckpt.load import reshard, reshard_sources, zero1_io
from nxd_ckpt.load.read_plan import ReadPlan
from nxd_ckpt.options import LoadOptions
from nxd_ckpt.ranks import replicas as replica_reads
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import Storage
from nxd_ckpt.tree import tensor_bytes


def prepare_reshard(
    coord: Coordinator, storage: Storage, info: TagDescription, topo: Topology, options: LoadOptions
) -> reshard.ReshardedLoad:
    """Every rank's plan of a load at another TP/PP size, checked on all ranks before anything is read."""
    tag = info.tag
    saved = info.metadata.sharding if info.metadata is not None else None
    if saved is None and options.sharding is None:
        raise LayoutMismatchError(
            f"checkpoint {storage.url}/{tag} was saved with TP={info.tp} PP={info.pp} but this job runs "
            f"{topo.describe()}, and it records no sharding (written by NxD, an older nxd_ckpt, or from a "
            "dict): pass sharding= to load_checkpoint (name patterns -> partition dim, or a model whose "
            "parameters carry NxD's attributes) to re-shard it, or load it with the same TP and PP sizes "
            "(DP may differ)"
        )
    trusted = options.allow_pickle

    def plan() -> reshard.ReshardedLoad:
        record = reshard_sources.source_record(storage, tag, info, saved, options.sharding, trusted=trusted)
        return reshard.ReshardedLoad(
            storage, tag, info, record, topo, options.model, options.optimizer, strict=options.strict,
            trusted=trusted,
        )  # fmt: skip

    return coord.run_all(plan, f"planning the load of {tag!r} at another parallel layout")


@dataclass(frozen=True)
class PlanRead:
    """One rank's ``plan`` carried out: its files (or re-sharded parts) read into the targets of ``options``."""

    storage: Storage
    plan: ReadPlan
    topo: Topology
    options: LoadOptions
    replicas: replica_reads.ReplicaGroup | None
    """This rank's DP replica group sharing the reads (made when ``plan.share_reads``), else None."""
    resharded: reshard.ReshardedLoad | None
    """The re-sharded load's parts (``prepare_reshard``, when ``plan.resharded``), else None."""

    @property
    def optimizer_replicas(self) -> replica_reads.ReplicaGroup | None:
        """The group sharing the optimizer file's reads (None for a ZeRO-1 shard: this rank's alone)."""
        return self.replicas if self.plan.optimizer_shares_reads else None

    def apply(self, device: torch.device | None) -> Any:
        """Read and load model, optimizer and scheduler into their targets; return the saved user content."""
        o, plan = self.options, self.plan
        optimizer_read = self._optimizer_read_ahead(device)
        try:
            if o.model is not None:
                state, source = self.model_state()
                adapters.load_model_state(o.model, state, strict=o.strict, source=source, device=device)
        except BaseException:
            if optimizer_read is not None:  # no thread is left writing into the optimizer's tensors
                concurrent.futures.wait([optimizer_read])
            raise
        if o.optimizer is not None:
            state, source = optimizer_read.result() if optimizer_read is not None else self.optimizer_state()
            adapters.load_optimizer_state(o.optimizer, state, source=source, device=device)
        if o.scheduler is not None and plan.scheduler is not None:
            state = self.read(plan.scheduler)
            source = f"{self.storage.url}/{plan.scheduler}"
            adapters.load_scheduler_state(o.scheduler, state, source=source, device=device)
        if self.storage.exists(plan.user_content):
            return statefile.read_plain(self.storage, plan.user_content, trusted=o.allow_pickle)
        return None

    def _optimizer_read_ahead(self, device: torch.device | None) -> concurrent.futures.Future | None:
        """The optimizer's files read on a thread of their own while the model's are read, so the storage stays
        busy while the model's bytes are copied (2 ranks, xser into the live module: 1.24 s -> 1.17 s, medians
        of 6). Only where that read needs no collective (a ZeRO-1 shard, or no DP replicas sharing reads: two
        threads must not run collectives at once) and everything lands in host memory (a load onto a device
        stages through one set of host buffers at a time)."""
        o = self.options
        if o.model is None or o.optimizer is None or self.resharded is not None:
            return None
        if self.optimizer_replicas is not None or (device is not None and device.type != "cpu"):
            return None
        if adapters.holds_device_tensors(o.model, "model") or adapters.holds_device_tensors(o.optimizer, "optimizer"):
            return None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nxd_ckpt_optimizer_read")
        try:
            return pool.submit(self.optimizer_state)
        finally:
            pool.shutdown(wait=False)

    def model_state(self) -> tuple[Any, str]:
        """The model's state and where it came from: straight into the live model's tensors (no second copy),
        checked against it first; or assembled from the parts it covers at another layout."""
        if self.resharded is not None:
            return self.resharded.model_state(), f"{self.storage.url}/{self.plan.tag}"
        o, path = self.options, self.plan.model
        assert path is not None  # planned for every load with a model at the saved layout
        source = f"{self.storage.url}/{path}"
        target = adapters.load_target(o.model, "model", strict=o.strict, source=source)
        return self.read(path, self.replicas, target), source

    def optimizer_state(self) -> tuple[Any, str]:
        """The optimizer's state: re-sharded, this rank's ZeRO-1 shard (re-cut when the DP size changed), or the
        replicated state of its (TP, PP) coordinate."""
        plan, topo, o = self.plan, self.topo, self.options
        if self.resharded is not None:
            return self.resharded.optimizer_state(), f"{self.storage.url}/{plan.tag}"
        path = plan.optimizer
        assert path is not None  # planned for every load with an optimizer at the saved layout
        source = f"{self.storage.url}/{path}"
        saved_dp = plan.saved_zero1_dp
        if plan.zero1_recut and topo.expert_parallel:
            raise LayoutMismatchError(
                f"checkpoint {self.storage.url}/{plan.tag} holds ZeRO-1 state for {saved_dp or 'full'} shards but "
                f"this job runs {topo.describe()}: re-sharding ZeRO-1 state under expert parallelism (expert "
                "parameters shard over expert-data-parallel groups) is not supported; use the saved DP size"
            )
        if plan.zero1_recut:  # ZeRO-1 saved with another DP size (or full): read only the rows this shard covers
            return zero1_io.load_resharded_state(self.storage, plan.tag, saved_dp, topo, trusted=o.allow_pickle), source
        target = adapters.load_target(o.optimizer, "optimizer")
        return self.read(path, self.optimizer_replicas, target), source

    def read(
        self, path: str, replicas: replica_reads.ReplicaGroup | None = None, target: statefile.LoadTarget | None = None
    ) -> Any:
        """One state file of the tag (into ``target``'s tensors when given); a missing one is a FormatError
        that says why (never written, or ZeRO-1 state in DCP format)."""
        storage = self.storage
        if not storage.exists(path):
            raise missing_file_error(storage, path)
        state = statefile.read_state_file(
            storage, path, trusted=self.options.allow_pickle, group=replicas, target=target
        )
        return target.finish(state) if target is not None else state


def missing_file_error(storage: Storage, path: str) -> FormatError:
    """Why a tag lacks ``path``: ZeRO-1 state written as DCP (NxD's ``use_zero1_dcp``), or damage."""
    tag_dir, _, rest = path.partition("/")
    if rest.startswith(layout.OPTIM_DIR + "/") and storage.exists(
        layout.tag_path(tag_dir, layout.OPTIM_DIR, layout.DCP_METADATA_FILE)
    ):
        return FormatError(
            f"{storage.url}/{tag_dir}/{layout.OPTIM_DIR} holds ZeRO-1 state in torch Distributed Checkpoint format "
            "(NxD's use_zero1_dcp=True), which nxd_ckpt does not read; load the model without the optimizer, or "
            "re-save the optimizer state with use_zero1_dcp=False"
        )
    return FormatError(
        f"checkpoint file {storage.url}/{path} is missing; the checkpoint is damaged or was saved "
        "without this state (load without it, or pick another tag)"
    )


def loaded_bytes(*targets: Any) -> int:
    """Tensor bytes now held by the load targets (modules/optimizers via state_dict, dicts as they are)."""
    return sum(tensor_bytes(t.state_dict() if hasattr(t, "state_dict") else t) for t in targets if t is not None)
