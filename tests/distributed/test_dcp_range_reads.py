"""nxd_ckpt.dcp.StorageReader on real gloo ranks reads only each rank's share (issue 53): a checkpoint saved on one
rank, loaded as ``Shard(0)`` DTensors onto twice the ranks, reads at most 1.1x each rank's share of the bytes on
every rank (DCP asks each rank for half of each saved chunk), bit-exact; and a rank whose own blocks are damaged
keeps its targets as they were."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.storage import DelegatingStorage

pytestmark = pytest.mark.device_independent  # CPU DTensors over gloo: runs once, in the CPU lane

ROWS, COLS = 256, 8192  # 8 MiB per tensor


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(3)}


class _Counting(DelegatingStorage):
    """Counts the bytes read of ``.distcp`` files through ``open_read`` (the reader's only route to them)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.bytes_read = 0

    def open_read(self, path: str):
        import contextlib

        counter = self

        class _Stream:
            def __init__(self, stream) -> None:
                self._stream = stream

            def readinto(self, b) -> int:
                n = self._stream.readinto(b) or 0
                counter.bytes_read += n if path.endswith(".distcp") else 0
                return n

            def __getattr__(self, name):
                return getattr(self._stream, name)

        @contextlib.contextmanager
        def opened():
            with self.inner.open_read(path) as stream:
                yield _Stream(stream)

        return opened()


def _sharded_targets() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]) for k in _full()}


def _load_share(path: str) -> None:
    warnings.simplefilter("ignore")
    targets = _sharded_targets()
    reader = StorageReader(path)
    counting = _Counting(reader.place.root)
    reader.place = dataclasses.replace(reader.place, root=counting)
    dcp.load(targets, storage_reader=reader)
    share = sum(t.to_local().numel() * t.to_local().element_size() for t in targets.values())
    for name, value in _full().items():
        assert torch.equal(targets[name].full_tensor(), value), name
    assert counting.bytes_read <= reader.bytes_read  # a local file's blocks are mapped, past the storage's count
    assert share <= reader.bytes_read <= 1.1 * share, (dist.get_rank(), reader.bytes_read, share)


def test_a_load_onto_twice_the_ranks_reads_about_each_ranks_share(tmp_path):
    path = str(tmp_path / "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_full(), storage_writer=StorageWriter(path), no_dist=True)
    run_on_ranks(_load_share, 2, {"path": path})


def _load_damaged(path: str) -> None:
    warnings.simplefilter("ignore")
    targets = _sharded_targets()
    for t in targets.values():
        t.to_local().fill_(-1.0)
    with pytest.raises(CheckpointException, match="__0_0.distcp is corrupt"):
        dcp.load(targets, storage_reader=StorageReader(path))
    if dist.get_rank() == 1:  # the damaged bytes are in its half: none of its targets was written
        assert all(torch.equal(t.to_local(), torch.full_like(t.to_local(), -1.0)) for t in targets.values())


def test_the_rank_that_finds_damage_keeps_its_targets(tmp_path):
    path = str(tmp_path / "step-1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_full(), storage_writer=StorageWriter(path), no_dist=True)
    file = os.path.join(path, "__0_0.distcp")
    metadata = dcp.FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == "w1"]
    with open(file, "r+b") as f:  # three quarters into w1's rows: rank 1's half
        f.seek(info.offset + info.length * 3 // 4)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x04]))
    run_on_ranks(_load_damaged, 2, {"path": path})
