"""The inspection API: manifests without tensor data, and one object read touching only the files that hold it."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import UnsafeCheckpointError
from nxd_ckpt.inspection import object_prefix, open_checkpoint
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.storage.base import DelegatingStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

MODEL_FILE = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


class CountingStorage(LocalStorage):
    """Local storage that records every file opened or read (a real LocalStorage otherwise)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.opened: list[str] = []

    def open_read(self, path: str):  # type: ignore[override]
        self.opened.append(path)
        return super().open_read(path)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self.opened.append(path)
        return super().read_bytes(path, offset, length)


class RemoteLikeStorage(DelegatingStorage):
    """Delegates to a LocalStorage but is not one (as S3 is not): reads go through ranged ``read_bytes`` calls,
    whose byte counts are recorded."""

    ranged_reads = True  # the capability S3 declares: partial reads go by ranges

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(LocalStorage(root))
        self.bytes_read: dict[str, int] = {}

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, length)
        self.bytes_read[path] = self.bytes_read.get(path, 0) + len(data)
        return data

    @contextlib.contextmanager
    def open_read(self, path: str):
        with self.inner.open_read(path) as f:
            self.bytes_read[path] = self.bytes_read.get(path, 0) + self.inner.size(path)
            yield f


def _large_state(n: int = 24, numel: int = 64 * 1024) -> dict[str, torch.Tensor]:
    """About 4 MiB of model state in ``n`` tensors of mixed dtypes."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(n):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        state[f"layers.{i}.weight"] = torch.randn(numel // 256, 256, generator=g).to(dtype)
    return state


def test_read_one_tensor_of_xser_checkpoint_opens_only_its_files(tmp_path):
    state = _large_state()
    state["norm.weight"] = torch.randn(16)  # small: the writer may keep it inside the reference file
    nxd.save_checkpoint(tmp_path, "step_1", model=state, use_xser=True)
    storage = CountingStorage(tmp_path)
    ckpt = open_checkpoint(storage)
    manifest = {o.path: o for o in ckpt.objects()}
    target = manifest["model/tp00_pp00/layers.7.weight"]
    assert (target.dtype, target.shape, target.nbytes) == ("bfloat16", (256, 256), 256 * 256 * 2)

    storage.opened.clear()
    tensor = ckpt.read("model/tp00_pp00/layers.7.weight")
    assert torch.equal(tensor, state["layers.7.weight"])
    ref = f"step_1/{MODEL_FILE}"
    assert set(storage.opened) <= {ref, ref + ".info.pt", target.file}, storage.opened
    assert target.file in storage.opened

    # And the proof by removal: with every other tensor file gone, the read still works.
    tensors_dir = tmp_path / "step_1" / (MODEL_FILE + ".tensors")
    for f in tensors_dir.iterdir():
        if f"step_1/{MODEL_FILE}.tensors/{f.name}" != target.file:
            f.unlink()
    fresh = open_checkpoint(tmp_path, "step_1")
    assert torch.equal(fresh.read("model/tp00_pp00/layers.7.weight"), state["layers.7.weight"])
    small = fresh.objects("model/tp00_pp00")[-1]
    assert (small.path, small.kind, small.shape) == ("model/tp00_pp00/norm.weight", "tensor", (16,))
    if small.file == ref:  # inlined: read from the reference file alone
        assert torch.equal(fresh.read("model/tp00_pp00/norm.weight"), state["norm.weight"])
    with pytest.raises(nxd.FormatError, match="tensor_"):
        fresh.read("model/tp00_pp00/layers.8.weight")


def test_plain_manifest_reads_only_the_pickle(tmp_path):
    state = _large_state()
    nxd.save_checkpoint(tmp_path, "step_1", model=state)
    storage = RemoteLikeStorage(tmp_path)
    objects = open_checkpoint(storage).objects()
    assert [o.path for o in objects] == [f"model/tp00_pp00/{k}" for k in state]
    assert all(o.kind == "tensor" and o.nbytes == state[o.path.rsplit("/", 1)[1]].nbytes for o in objects)
    path = f"step_1/{MODEL_FILE}"
    size = (tmp_path / path).stat().st_size
    assert size > 4_000_000
    assert storage.bytes_read[path] < size // 20, (storage.bytes_read[path], size)

    # Reading one tensor adds its zip record and a few small ranges (the zip directory again), not the file.
    before = storage.bytes_read[path]
    ckpt = open_checkpoint(storage)
    ckpt.objects()
    structure = storage.bytes_read[path] - before
    tensor = ckpt.read("model/tp00_pp00/layers.5.weight")
    assert torch.equal(tensor, state["layers.5.weight"])
    read = storage.bytes_read[path] - before - structure
    assert tensor.nbytes <= read < tensor.nbytes + 16384, (read, tensor.nbytes)


def test_plain_read_of_views_and_odd_dtypes(tmp_path):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {"base": base, "view": base[1:3, ::2], "flag": torch.tensor([True, False]), "empty": torch.empty(0, 3)}
    state["bf16"] = torch.randn(5, dtype=torch.bfloat16)
    nxd.save_checkpoint(tmp_path, "t", model=state)
    ckpt = open_checkpoint(RemoteLikeStorage(tmp_path))
    for key, expected in state.items():
        got = ckpt.read(f"model/tp00_pp00/{key}")
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
    view = ckpt.read("model/tp00_pp00/view")
    assert view.untyped_storage().nbytes() == view.nbytes  # compacted, not the whole shared record


def test_plain_reads_tensor_and_subtree(tmp_path):
    model, opt, sched = make_training(seed=3, device="cpu")
    train_steps(model, opt, sched, 2, seed=3)
    nxd.save_checkpoint(tmp_path, "step_2", model=model, optimizer=opt, scheduler=sched, user_content={"step": 2})
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.tag == "step_2" and ckpt.complete
    assert ckpt.layout().describe() == "DP=1 TP=1 PP=1"
    assert [sf.prefix for sf in ckpt.state_files()] == [
        "model/tp00_pp00",
        "optim/dp00_tp00_pp00",
        "scheduler",
        "user_content",
    ]
    weight = ckpt.read("model/tp00_pp00/fc1.weight")
    assert torch.equal(weight, model.state_dict()["fc1.weight"])
    assert weight.untyped_storage().nbytes() == weight.nbytes  # owns exactly its memory
    assert_state_equal(ckpt.read("optim/dp00_tp00_pp00/state/0"), opt.state_dict()["state"][0])
    assert_state_equal(ckpt.read("model/tp00_pp00"), model.state_dict())
    assert ckpt.read("user_content/step") == 2
    values = {o.path: o.value for o in ckpt.objects("scheduler") if o.kind == "value"}
    assert values["scheduler/last_epoch"] == sched.state_dict()["last_epoch"]
    with pytest.raises(KeyError, match="no key 'fc9.weight'.*fc1.weight"):
        ckpt.read("model/tp00_pp00/fc9.weight")
    with pytest.raises(KeyError, match="names no state file"):
        ckpt.read("model/tp05_pp00/fc1.weight")


class _Custom:
    def __init__(self) -> None:
        self.x = 1


def test_pickled_classes_need_allow_pickle(tmp_path):
    nxd.save_checkpoint(tmp_path, "t", model={"w": torch.ones(2)}, user_content={"obj": _Custom()})
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        open_checkpoint(tmp_path).objects("user_content")
    objects = open_checkpoint(tmp_path, allow_pickle=True).objects("user_content")
    assert [(o.path, o.dtype) for o in objects] == [("user_content/obj", "_Custom")]


def test_incomplete_tag_opens_only_when_asked(tmp_path):
    nxd.save_checkpoint(tmp_path, "t", model={"w": torch.ones(2)})
    os.remove(tmp_path / "t" / "done")
    with pytest.raises(nxd.CheckpointNotFoundError, match="incomplete"):
        open_checkpoint(tmp_path, "t")
    ckpt = open_checkpoint(tmp_path, "t", allow_incomplete=True)
    assert not ckpt.complete and torch.equal(ckpt.read("model/tp00_pp00/w"), torch.ones(2))


@pytest.mark.parametrize(
    ("rel", "prefix"),
    [
        ("model/dp_rank_00_tp_rank_01_pp_rank_02.pt", "model/tp01_pp02"),
        ("optim/dp_rank_01_tp_rank_00_pp_rank_00.pt", "optim/dp01_tp00_pp00"),
        ("optim/full_tp_rank_00_pp_rank_01.pt", "optim/full_tp00_pp01"),
        ("model/dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt", "model/ep01_tp00_pp00"),
        ("scheduler.pt", "scheduler"),
        ("nxd_ckpt/rank_state_00001.pt", "nxd_ckpt/rank_state_00001"),
    ],
)
def test_object_prefixes(rel, prefix):
    assert object_prefix(rel) == prefix


def _nxd_style_zero1_tag(root) -> dict:
    """A tag as NxD writes it with ZeRO-1 over DP=2: plain torch.save files, markers, no nxd_ckpt files."""
    tag = root / "step_7"
    (tag / "model").mkdir(parents=True)
    (tag / "optim").mkdir()
    (tag / "checkpoint").write_text("1")
    model = {"w": torch.arange(8.0).reshape(4, 2)}
    torch.save(model, tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    shards = {}
    for dp in range(2):
        shards[dp] = {
            "base_state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 2), float(dp))}},
            "shape_info": {0: torch.Size([4, 2])},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        }
        torch.save(shards[dp], tag / "optim" / f"dp_rank_{dp:02d}_tp_rank_00_pp_rank_00.pt")
    (tag / "done").write_text("1")
    return {"model": model, "shards": shards}


def test_nxd_written_checkpoint(tmp_path):
    from nxd_ckpt.tools.completeness import check_structure

    saved = _nxd_style_zero1_tag(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.tag == "step_7" and ckpt.metadata is None
    assert ckpt.layout().describe() == "DP=2 TP=1 PP=1, ZeRO-1"
    paths = {o.path: o for o in ckpt.objects()}
    assert paths["optim/dp01_tp00_pp00/base_state/0/exp_avg"].shape == (2, 2)
    assert paths["optim/dp01_tp00_pp00/param_groups/0/params"].value == [0]
    assert torch.equal(ckpt.read("optim/dp01_tp00_pp00/base_state/0/exp_avg"), torch.ones(2, 2))
    assert torch.equal(ckpt.read("model/tp00_pp00/w"), saved["model"]["w"])
    assert check_structure(ckpt) == []

    (tmp_path / "step_7" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").unlink()
    problems = check_structure(open_checkpoint(tmp_path))
    assert [p.path for p in problems] == ["step_7/optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"]


def test_the_old_module_name_warns_and_gives_the_same_objects():
    """``nxd_ckpt.inspect`` (which shadowed the standard library's ``inspect``) still imports, with a
    DeprecationWarning naming the new module, and its names are ``nxd_ckpt.inspection``'s own."""
    import importlib
    import sys

    from nxd_ckpt import inspection

    sys.modules.pop("nxd_ckpt.inspect", None)
    with pytest.warns(DeprecationWarning, match=r"nxd_ckpt\.inspect is deprecated.*import nxd_ckpt\.inspection"):
        old = importlib.import_module("nxd_ckpt.inspect")
    assert old.Checkpoint is inspection.Checkpoint and old.open_checkpoint is inspection.open_checkpoint
    assert old.object_prefix is inspection.object_prefix  # a name outside __all__ too
    assert set(old.__all__) == set(inspection.__all__)
