"""Replica read sharing: DP replicas that load the same state file read each tensor from storage once between
them and share the bytes (or a first replica's result, or a failure) over their own process group."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nxd_ckpt.errors import FormatError
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.failures import format_exception
from nxd_ckpt.ranks.topology import Topology

PACK_BELOW_BYTES = 1 << 20
"""Tensors smaller than this are broadcast packed together (one collective per ``PACK_BYTES``), not one by one."""
PACK_BYTES = 64 << 20

Destination = Callable[[int, torch.Tensor], "torch.Tensor | None"]
"""Given a tid and a ``meta`` tensor like it, the existing tensor to receive it (None: fresh memory)."""


class ReplicaGroup:
    """DP replicas that load the same state file together: each reads a share of the tensors, then shares them.

    ``broadcast`` is the one seam for moving tensor bytes between replicas (gloo over CPU tensors today; a
    device collective could take its place on Neuron hardware). Every replica must make the same calls.
    """

    def __init__(self, coordinator: Coordinator, ranks: Sequence[int], group: Any, same_host: bool = False) -> None:
        self.coordinator = coordinator
        self.ranks = tuple(ranks)
        self.group = group
        self.index = self.ranks.index(coordinator.rank)
        self.same_host = same_host
        """Whether every replica runs on this host (they can then share reads through the page cache)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def broadcast(self, tensor: torch.Tensor, src_index: int) -> None:
        """Fill ``tensor`` in place on every replica with replica ``src_index``'s bytes."""
        self.coordinator.broadcast_tensor(tensor, src=self.ranks[src_index], group=self.group)

    def broadcast_object(self, obj: Any, src_index: int) -> Any:
        return self.coordinator.broadcast_object(obj, src=self.ranks[src_index], group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.coordinator.all_gather_object(obj, group=self.group)

    def shared(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the first replica and give its result (or its error) to every replica."""
        payload, error = b"", None
        if self.index == 0:
            try:
                payload = pickle.dumps(fn())  # pickled here, so a failure cannot leave the replicas waiting
            except BaseException as e:  # sent to the replicas, then raised
                error = e
        message, payload = self.broadcast_object((None if error is None else format_exception(error), payload), 0)
        if error is not None:
            raise error
        if message is not None:
            raise FormatError(f"replica rank {self.ranks[0]} could not read {what}: {message}")
        return pickle.loads(payload)

    def agree(self, loaded: dict[int, torch.Tensor], error: BaseException | None, what: str) -> dict[int, torch.Tensor]:
        """Replicas that each read every tensor raise together when any of them failed (one small collective)."""
        messages = self.all_gather_object(None if error is None else format_exception(error))
        if error is not None:
            raise error
        failed = [(self.ranks[j], msg) for j, msg in enumerate(messages) if msg is not None]
        if failed:
            raise FormatError(f"replica rank {failed[0][0]} could not read {what}: {failed[0][1]}")
        return loaded

    def exchange(
        self,
        loaded: dict[int, torch.Tensor],
        error: BaseException | None,
        owners: list[list[int]],
        what: str,
        destination: Destination | None = None,
    ) -> dict[int, torch.Tensor]:
        """Give every replica every tensor: each owner broadcasts the tensors it read (small ones packed), into
        the tensors ``destination`` names where given."""
        meta = {tid: (t.dtype, tuple(t.shape)) for tid, t in loaded.items()}
        gathered = self.all_gather_object((None if error is None else format_exception(error), meta))
        if error is not None:
            raise error
        failed = [(self.ranks[j], msg) for j, (msg, _) in enumerate(gathered) if msg is not None]
        if failed:
            raise FormatError(f"replica rank {failed[0][0]} could not read its part of {what}: {failed[0][1]}")
        tensors = dict(loaded)
        for j, tids in enumerate(owners):
            metas = gathered[j][1]
            pack: list[int] = []
            pack_bytes = 0
            for tid in tids:
                dtype, shape = metas[tid]
                if tid not in tensors:
                    like = torch.empty(shape, dtype=dtype, device="meta")
                    dest = destination(tid, like) if destination is not None else None
                    tensors[tid] = dest if dest is not None else torch.empty(shape, dtype=dtype)
                nbytes = _nbytes(tensors[tid])
                if nbytes == 0:
                    continue
                if nbytes >= PACK_BELOW_BYTES:
                    self.broadcast(_bytes_of(tensors[tid]), j)
                    continue
                pack.append(tid)
                pack_bytes += nbytes
                if pack_bytes >= PACK_BYTES:
                    self._broadcast_packed(j, [tensors[t] for t in pack])
                    pack, pack_bytes = [], 0
            if pack:
                self._broadcast_packed(j, [tensors[t] for t in pack])
        return tensors

    def _broadcast_packed(self, src_index: int, tensors: list[torch.Tensor]) -> None:
        if self.index == src_index:
            self.broadcast(torch.cat([_bytes_of(t) for t in tensors]), src_index)
            return
        flat = torch.empty(sum(_nbytes(t) for t in tensors), dtype=torch.uint8)
        self.broadcast(flat, src_index)
        offset = 0
        for t in tensors:
            n = _nbytes(t)
            _bytes_of(t).copy_(flat[offset : offset + n])
            offset += n


def replica_groups(coordinator: Coordinator, topo: Topology) -> ReplicaGroup | None:
    """This rank's model replica group (None without replicas); creates every replica group, in the same order
    on every rank, as process-group creation requires."""
    groups = topo.replica_groups()
    if not coordinator.distributed or len(groups[0]) <= 1:
        return None
    hosts = coordinator.host_names()
    mine = None
    for ranks in groups:
        group = coordinator.subgroup(ranks)
        if coordinator.rank in ranks:
            mine = ReplicaGroup(coordinator, ranks, group, same_host=len({hosts[r] for r in ranks}) == 1)
    return mine


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (gloo then never sees dtypes it lacks, e.g. bf16)."""
    return tensor.reshape(-1).view(torch.uint8)
