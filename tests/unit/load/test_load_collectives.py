"""A verified load hands each rank the manifest records of the files it reads, not every rank's manifests: the bytes
a rank receives in collectives during a load do not grow with the world (thread ranks, ``ThreadWorld(count=True)``
counting what gloo would carry), and every file a rank reads is still checked, on every rank, at any DP size and
when re-sharded."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_ckpt import LayoutMismatchError
from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.format import integrity, layout
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.threadworld import ThreadWorld

pytestmark = pytest.mark.device_independent  # the load's collectives: runs once, in the CPU lane

TENSORS = 6
"""Model tensors per rank; with a file per xser tensor a rank writes about 2 * TENSORS + 8 files."""


def _topos(n: int, tp: int, dp: int) -> list[Topology]:
    """One host of ``n`` ranks at TP=tp DP=dp (the groups built once, for every rank)."""
    shared = Topology(tp_size=tp, dp_size=dp)
    return [
        Topology(tp_size=tp, dp_size=dp, rank=r, local_rank=r, local_world_size=n, groups=shared.groups)
        for r in range(n)
    ]


def _state(topo: Topology, fill: float) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One rank's model shard and ZeRO-1 optimizer shard (``base_state``/``shape_info``, as NxD's)."""
    model = {f"layers.{i}.weight": torch.full((8,), fill + i) for i in range(TENSORS)}
    base = {i: {"exp_avg": torch.full((4,), fill), "exp_avg_sq": torch.full((4,), fill + 1)} for i in range(TENSORS)}
    shapes = {i: torch.Size([4 * topo.zero1_size]) for i in range(TENSORS)}
    return model, {"base_state": base, "shape_info": shapes}


class _Job:
    """``n`` thread ranks at TP=tp, DP=n/tp, with a manager each; ``count=True`` counts their collectives."""

    def __init__(self, n: int, tp: int) -> None:
        self.world = ThreadWorld(n, count=True)
        self.topos = _topos(n, tp, n // tp)
        self.managers = [
            CheckpointManager(coordinator=self.world.coordinator(r), topology=t) for r, t in enumerate(self.topos)
        ]

    def save(self, root: Path, tag: str) -> None:
        def save(rank: int) -> None:
            model, optim = _state(self.topos[rank], float(rank))
            self.managers[rank].save(
                root, tag, model=model, optimizer=optim, zero1_optimizer=True, use_xser=True,
                user_content={"step": 3},
            )  # fmt: skip

        self.world.run(save)

    def load(self, root: Path, tag: str | None = None) -> list[tuple[dict, dict, Any]]:
        """Every rank's loaded (model, optimizer, user content), into fresh dicts."""

        def load(rank: int) -> tuple[dict, dict, Any]:
            model: dict[str, Any] = {}
            optim: dict[str, Any] = {}
            # half the host's ranks per wave: xser DP replicas then read alone (ThreadWorld has no subgroups)
            workers = max(1, len(self.managers) // 2)
            content = self.managers[rank].load(root, tag, model=model, optimizer=optim, num_workers=workers)
            return model, optim, content

        return self.world.run(load)

    def received(self) -> list[int]:
        """Bytes each rank has received in collectives so far."""
        return [sum(b for _, b in kinds.values()) for kinds in self.world.collectives]

    def close(self) -> None:
        self.world.close()


@pytest.fixture(autouse=True)
def _a_file_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")


def _load_recv(tmp_path: Path, n: int) -> tuple[int, int]:
    """(max bytes a rank received in collectives during one verified load, files in the tag's manifests) at
    ``n`` ranks, TP=n/2 DP=2 (ZeRO-1, xser)."""
    job = _Job(n, n // 2)
    try:
        root = tmp_path / f"w{n}"
        job.save(root, "s1")
        before = job.received()
        loaded = job.load(root)
        per_rank = [a - b for a, b in zip(job.received(), before, strict=True)]
        for rank, (model, optim, content) in enumerate(loaded):
            assert content == {"step": 3}
            tp_peer = rank % (n // 2)  # model replicas: the DP-rank-0 replica's tensors (rank tp_peer)
            assert torch.equal(model["layers.2.weight"], torch.full((8,), float(tp_peer) + 2))
            assert torch.equal(optim["base_state"][1]["exp_avg"], torch.full((4,), float(rank)))
        files = len(integrity.read_index(LocalStorage(root), "s1"))
        return max(per_rank), files
    finally:
        job.close()


def test_the_bytes_a_rank_receives_in_a_load_do_not_grow_with_the_world(tmp_path):
    small, small_files = _load_recv(tmp_path, 4)
    large, large_files = _load_recv(tmp_path, 16)
    assert large_files >= 3.5 * small_files  # the index grows with the world...
    # ...the bytes a rank receives do not (the whole index to every rank: 8,040 -> 29,952 B, 3.7x)
    assert large <= 1.3 * small, f"max bytes received per rank: {small} at 4 ranks, {large} at 16"


def _damage(root: Path, rel: str) -> None:
    """Flip one byte in the middle of ``root/rel`` (its size stays)."""
    path = root / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify_counts(job: _Job, root: Path, tag: str) -> list[tuple[int, int]]:
    """Run a load on every rank with a spy on its VerifyingStorage: (files verified, index fallbacks) per rank."""
    real = integrity.VerifyingStorage.__init__

    def spy(self: integrity.VerifyingStorage, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        spies.append(self)

    spies: list[integrity.VerifyingStorage] = []
    integrity.VerifyingStorage.__init__ = spy  # type: ignore[method-assign]
    try:
        job.load(root, tag)
    finally:
        integrity.VerifyingStorage.__init__ = real  # type: ignore[method-assign]
    assert len(spies) == len(job.managers)
    return [(s.files_verified, len(s.index_fallbacks)) for s in spies]


def test_a_damaged_file_is_caught_on_a_rank_other_than_0(tmp_path):
    job = _Job(4, 2)  # TP=2 DP=2
    try:
        job.save(tmp_path, "s1")
        # rank 3's ZeRO-1 shard: read only by rank 3 (DP rank 1, TP rank 1), whose share holds its record
        t3 = job.topos[3]
        shard = layout.optim_file("s1", t3.zero1_rank, t3.tp_rank, t3.pp_rank)
        tensor = layout.xser_tensor_file(shard, 0)
        assert os.path.exists(tmp_path / tensor)
        _damage(tmp_path, tensor)
        with pytest.raises(IntegrityError, match=r"tensor_0\.pt is corrupt"):
            job.load(tmp_path, "s1")
    finally:
        job.close()


def test_every_rank_verifies_its_files_from_its_share_without_reading_the_manifests(tmp_path):
    job = _Job(4, 2)
    try:
        job.save(tmp_path, "s1")
        counts = _verify_counts(job, tmp_path, "s1")
        assert all(verified > 2 * TENSORS for verified, _ in counts), counts
        assert all(fallbacks == 0 for _, fallbacks in counts), counts
    finally:
        job.close()


def test_a_load_at_another_dp_size_verifies_the_other_shards_it_reads(tmp_path):
    """Saved at TP=2 DP=2, loaded at TP=2 DP=1: each rank's new ZeRO-1 shard comes from both saved shards of
    its TP rank, checked from its share (no fallback to the whole index); a damaged one is caught."""
    saver = _Job(4, 2)
    try:
        saver.save(tmp_path, "s1")
    finally:
        saver.close()
    loader = _Job(2, 2)
    try:
        counts = _verify_counts(loader, tmp_path, "s1")
        assert all(fallbacks == 0 for _, fallbacks in counts), counts
        loaded = loader.load(tmp_path, "s1")
        for rank, (_, optim, _) in enumerate(loaded):  # rows of saved DP ranks 0 and 1 of TP rank ``rank``
            dp0, dp1 = loader.topos[rank].tp_rank, loader.topos[rank].tp_rank + 2  # their saving ranks
            want = torch.cat([torch.full((4,), float(dp0)), torch.full((4,), float(dp1))])
            assert torch.equal(optim["base_state"][0]["exp_avg"], want)
        # the DP-rank-1 shard of TP rank 1: read only by rank 1 now, and not its own file at the saved layout
        _damage(tmp_path, layout.xser_tensor_file(layout.optim_file("s1", 1, 1, 0), 0))
        with pytest.raises(IntegrityError, match=r"tensor_0\.pt is corrupt"):
            loader.load(tmp_path, "s1")
    finally:
        loader.close()


def test_a_resharded_load_verifies_with_the_whole_index(tmp_path):
    """Saved at TP=2, loaded at TP=1: a re-sharded load reads parts of both TP ranks' files; it gets the whole
    index (no fallback) and still catches a damaged file (a size change: parts cannot be hashed)."""
    saver = _Job(2, 2)  # TP=2 DP=1
    try:

        def save(rank: int) -> None:
            model = {"w": torch.arange(8.0) + 8 * rank}
            saver.managers[rank].save(tmp_path, "s1", model=model)

        saver.world.run(save)
    finally:
        saver.close()
    loader = _Job(1, 1)
    try:
        model: dict[str, Any] = {"w": torch.zeros(16)}
        manager = loader.managers[0]
        manager.load(tmp_path, "s1", model=model, sharding={"w": 0})
        assert torch.equal(model["w"], torch.arange(16.0))
        path = tmp_path / layout.model_file("s1", 1, 0)
        path.write_bytes(path.read_bytes() + b"x")
        with pytest.raises((IntegrityError, LayoutMismatchError), match="bytes"):
            manager.load(tmp_path, "s1", model={"w": torch.zeros(16)}, sharding={"w": 0})
    finally:
        loader.close()


def test_master_computes_and_scatters_hands_each_rank_its_part_or_rank_0s_error():
    world = ThreadWorld(3, count=True)
    try:

        def parts(rank: int) -> tuple[Any, Any]:
            coord = world.coordinator(rank)
            return coord.master_computes_and_scatters(lambda: ("common", [f"part {r}" for r in range(3)]), "parts")

        assert world.run(parts) == [("common", f"part {r}") for r in range(3)]
        assert world.collectives[1]["scatter"] == [1, len(pickle.dumps("part 0"))]

        def failing(rank: int) -> str:
            def broken() -> tuple[str, list[str]]:
                raise IntegrityError("rank 0 found a damaged manifest")

            try:
                world.coordinator(rank).master_computes_and_scatters(broken, "parts")
            except IntegrityError as e:
                return str(e)
            return "no error"

        messages = world.run(failing)
        assert all("rank 0 found a damaged manifest" in m for m in messages), messages
    finally:
        world.close()
