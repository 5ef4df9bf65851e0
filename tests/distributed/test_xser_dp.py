"""xser across DP replicas on real gloo ranks: every replica writes a share of a replicated file, and replicas
loading the same file read each tensor file from storage once between them: counted per file when they
broadcast (replicas on different hosts), counted at the block device when they share this host's page cache."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from nxd_ckpt import statefile
from nxd_ckpt.errors import FormatError
from nxd_ckpt.ranks import replicas
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import ReadCountingStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps


def _big_model() -> dict:
    """A model-like dict with tensors large enough that zip bookkeeping is noise next to the data."""
    gen = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(64 + 16 * i, 256, generator=gen) for i in range(6)} | {
        "norm.weight": torch.ones(256),
        "emb": torch.randn(300, 128, generator=gen).to(torch.bfloat16),
    }


@run_with_ranks(2)
def test_dp2_save_splits_writes_and_load_reads_each_tensor_once(tmp_path):
    coord = Coordinator()
    model = _big_model()
    net, opt, sched = make_training(seed=3)
    train_steps(net, opt, sched, steps=2, seed=3)
    ckpt = str(tmp_path / "ckpt")
    report = nxd.save_checkpoint(ckpt, "step_2", model=model, optimizer=opt, scheduler=sched, use_xser=True)
    # Both replicas wrote about half of the replicated model and optimizer files.
    shares = coord.all_gather_object(report.bytes_written)
    assert min(shares) > 0.3 * sum(shares), shares
    model_file = os.path.join(ckpt, "step_2", "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    big = [k for k, v in model.items() if v.numel() * v.element_size() >= statefile.inline_below_bytes()]
    assert len(os.listdir(model_file + ".tensors")) == len(big) == len(torch.load(model_file + ".info.pt"))
    assert not os.path.exists(os.path.join(ckpt, "step_2", "model", "dp_rank_01_tp_rank_00_pp_rank_00.pt"))

    # Verified (default) load: every state comes back exactly.
    model2: dict = {}
    _, opt2, sched2 = make_training(seed=11)
    nxd.load_checkpoint(ckpt, model=model2, optimizer=opt2, scheduler=sched2)
    assert_state_equal(model, model2)
    assert_state_equal(opt.state_dict(), opt2.state_dict())

    # Bytes read from storage, counted under the load (verify=False: checksum passes re-read files on purpose),
    # with the broadcast that replicas on different hosts use (here they would share the page cache instead).
    storage = ReadCountingStorage(ckpt)
    model3: dict = {}
    os.environ["NXD_CKPT_REPLICA_READS"] = "broadcast"
    try:
        nxd.load_checkpoint(storage, model=model3, verify=False)
    finally:
        del os.environ["NXD_CKPT_REPLICA_READS"]
    assert_state_equal(model, model3)
    reads = coord.all_gather_object(storage.bytes_read)
    tensor_reads = [p for r in reads for p in r if ".tensors/tensor_" in p]
    assert len(tensor_reads) == len(set(tensor_reads)) == len(big), tensor_reads  # one reader per tensor
    assert all(len(_tensor_files_read_from(r)) > 0 for r in reads)  # both replicas did part of the reading
    model_reads = [p for r in reads for p in r if "/model/" in p and ".tensors/" not in p]
    assert sorted(model_reads) == sorted({p for p in model_reads}), model_reads  # reference and info read once
    total = sum(v for r in reads for p, v in r.items() if "/model/" in p)
    on_disk = sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(os.path.join(ckpt, "step_2", "model"))
        for f in files
    )
    # The DP group read the model once (plus zip directory re-reads), not DP=2 times.
    assert on_disk <= total <= 1.1 * on_disk, (total, on_disk)


def _tensor_files_read_from(bytes_read: dict[str, int]) -> set[str]:
    return {p for p in bytes_read if ".tensors/tensor_" in p}


@run_with_ranks(2)
def test_dp2_shared_read_reports_a_missing_tensor_file_on_every_replica(tmp_path):
    rank = dist.get_rank()
    coord = Coordinator()
    topo = Topology(dp_size=2, rank=rank, local_rank=rank, local_world_size=2)
    storage = LocalStorage(str(tmp_path))
    path = "t/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    state = {f"p{i}": torch.full((20_000 * (i + 1),), float(i)) for i in range(4)}  # files, not inline
    statefile.write_state_file(storage, path, state, xser_encoding=True, replicas=(0, 1), rank=rank)
    coord.barrier()
    group = replicas.replica_groups(coord, topo)
    assert group is not None and group.ranks == (0, 1)
    assert_state_equal(state, statefile.read_state_file(storage, path, group=group))
    coord.barrier()
    if rank == 0:
        os.unlink(os.path.join(str(tmp_path), path + ".tensors", "tensor_3.pt"))  # read by one replica only
    coord.barrier()
    try:
        statefile.read_state_file(storage, path, group=group)
    except FormatError as e:
        assert "tensor_3.pt" in str(e), str(e)
    else:
        raise AssertionError("a missing tensor file must fail the load on every replica")


def _device_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from the block device (None where the kernel does not say)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def _evict_from_page_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@run_with_ranks(2)
def test_dp2_on_one_host_share_reads_through_the_page_cache(tmp_path):
    """Same-host replicas each read every tensor file, but the device serves the model once (block-layer count)."""
    coord = Coordinator()
    gen = torch.Generator().manual_seed(7)  # the same model on both replicas
    model = _big_model() | {f"big{i}": torch.randn(256, 1024, generator=gen) for i in range(8)}  # I/O dominates
    ckpt = str(tmp_path / "ckpt")
    nxd.save_checkpoint(ckpt, "step_1", model=model, use_xser=True)
    group = replicas.replica_groups(coord, Topology(dp_size=2, rank=coord.rank, local_rank=coord.rank))
    assert group is not None and group.same_host
    model_dir = os.path.join(ckpt, "step_1", "model")
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(model_dir) for f in files)

    storage = ReadCountingStorage(ckpt)
    if coord.rank == 0:
        _evict_from_page_cache(ckpt)
    coord.barrier()
    before = _device_read_bytes()
    loaded: dict = {}
    nxd.load_checkpoint(storage, model=loaded, verify=False)
    after = _device_read_bytes()
    assert_state_equal(model, loaded)
    # Each replica read every tensor file itself (no broadcast) ...
    reads = coord.all_gather_object(storage.bytes_read)
    assert all(_tensor_files_read_from(r) == _tensor_files_read_from(reads[0]) for r in reads)
    assert len(_tensor_files_read_from(reads[0])) == len(
        os.listdir(model_dir + "/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors")
    )
    # ... yet the device served the model about once between them, not twice.
    device = coord.all_gather_object(None if before is None or after is None else after - before)
    if any(d is None for d in device) or sum(device) == 0:
        pytest.skip("the kernel does not account block-device reads per process here (/proc/self/io)")
    assert sum(device) < 1.5 * on_disk, (device, on_disk)
    assert sum(device) > 0.5 * on_disk, (device, on_disk)  # the eviction worked: this was a cold read


@run_with_ranks(2)
def test_dp2_async_xser_save_stages_only_this_replicas_share(tmp_path):
    """Each replica copies to host memory only the replicated tensors it writes (about half), not the whole model."""
    coord = Coordinator()
    gen = torch.Generator().manual_seed(9)
    model = {f"w{i}": torch.randn(128, 512, generator=gen) for i in range(8)} | {"norm": torch.ones(512)}
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    ckpt = str(tmp_path / "ckpt")
    report = nxd.save_checkpoint(ckpt, "step_1", model=model, use_xser=True, async_save=True)
    expected = {k: v.clone() for k, v in model.items()}
    for t in model.values():
        t.add_(1.0)  # the snapshot was taken at call time, shares and metadata-only tensors alike
    report.wait()
    nxd.finalize_checkpoint()
    staged = coord.all_gather_object(report.staging_allocated_bytes)
    assert all(0.3 * model_bytes < b < 0.7 * model_bytes for b in staged), (staged, model_bytes)
    loaded: dict = {}
    nxd.load_checkpoint(ckpt, model=loaded)
    assert_state_equal(expected, loaded)
