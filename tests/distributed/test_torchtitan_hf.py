"""``last_save_in_hf`` and ``initial_load_in_hf`` of nxd_ckpt.torchtitan.CheckpointManager against TorchTitan 0.3.0's
own manager, with the same model and state-dict adapter (TorchTitan's ``StateDictAdapter``, its file numbers read
from an ``hf_assets_path`` index by TorchTitan's code): the same files, index, names, dtypes and bytes, in one
process and with FSDP2 ``DTensor`` state on 2 gloo ranks; a re-save replacing the step whole; a rank's failed write
raised on every rank; Hugging Face folders (ours, and downloaded ones: truncated, a header past its file, a wrong
shape) checked before the model changes, naming the shard; a restart after the last step resuming the DCP steps."""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]', Python >= 3.11)"
)

import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpointer import CheckpointManager as TitanManager

from harness import titan_hf, titan_job
from harness.multiprocess import run_on_ranks
from nxd_ckpt.errors import IntegrityError
from nxd_ckpt.format import manifests
from nxd_ckpt.torchtitan import CheckpointManager

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane

INDEX = titan_hf.INDEX


@pytest.fixture(scope="module", autouse=True)
def _gloo_world_of_one() -> Iterator[None]:
    with titan_job.gloo_world_of_one():
        yield


def _header_order(path: str) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of a file's tensors in data order, from its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    ordered = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(k, v["dtype"], v["shape"]) for k, v in ordered]


def _files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def assert_same_hf_folders(theirs: str, ours: str) -> None:
    """Ours holds what TorchTitan's manager wrote: file names, index, each file's tensors (names, order, dtypes,
    shapes, bytes), loaded with ``safetensors``; and no ``sharded/`` copy, its files in our manifest."""
    assert _files(ours) == _files(theirs) and _files(ours)
    with open(os.path.join(theirs, INDEX)) as a, open(os.path.join(ours, INDEX)) as b:
        assert json.load(a) == json.load(b)
    for name in _files(theirs):
        assert _header_order(os.path.join(ours, name)) == _header_order(os.path.join(theirs, name)), name
        want, got = load_file(os.path.join(theirs, name)), load_file(os.path.join(ours, name))
        assert want.keys() == got.keys()
        for key in want:
            assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    assert os.path.isdir(os.path.join(theirs, "sharded")) and sorted(os.listdir(ours)) == [
        *_files(ours),
        INDEX,
        "nxd_ckpt",
    ]
    records: dict[str, manifests.FileRecord] = {}
    for name in os.listdir(os.path.join(ours, "nxd_ckpt")):  # one manifest per rank
        with open(os.path.join(ours, "nxd_ckpt", name), "rb") as f:
            records.update(manifests.parse_manifest(f.read(), name)[1])
    for rel in [*_files(ours), INDEX]:
        with open(os.path.join(ours, rel), "rb") as f:
            assert records[rel].size == os.path.getsize(os.path.join(ours, rel))
            assert records[rel].digest == manifests.hash_stream(f)[1], rel


@pytest.mark.parametrize("files", [0, 2, 3], ids=["no-index", "index-2-files", "index-3-files"])
def test_both_managers_write_the_same_last_step(tmp_path, files):
    """The same model and adapter; ``hf_assets_path`` without an index (one file) or with one spreading the
    tensors over 2 or 3 files; ``export_dtype`` bf16 applied before ``to_hf``."""
    names = titan_hf.hf_names(titan_hf.model(0))
    assets = titan_hf.write_assets(str(tmp_path / "assets"), names, files) if files else None
    for kind, cls in (("theirs", TitanManager), ("ours", CheckpointManager)):
        ckpt = titan_hf.manager(cls, str(tmp_path / kind), titan_hf.model(0), assets)
        assert ckpt.save(titan_hf.STEP, last_step=True)
        ckpt.close()
    folder = os.path.join("ckpt", f"step-{titan_hf.STEP}")
    assert_same_hf_folders(str(tmp_path / "theirs" / folder), str(tmp_path / "ours" / folder))
    assert len(_files(str(tmp_path / "ours" / folder))) == max(files, 1)
    assert titan_hf.folder_version(str(tmp_path / "ours" / folder), (0,)) == 0
    assert sorted(os.listdir(tmp_path / "ours" / "ckpt")) == [f"step-{titan_hf.STEP}"]  # nothing hidden left


def test_export_dtype_float32_keeps_the_model_dtype(tmp_path):
    ckpt = titan_hf.manager(CheckpointManager, str(tmp_path), titan_hf.model(0), None, export_dtype="float32")
    ckpt.save(titan_hf.STEP, last_step=True)
    got = load_file(str(tmp_path / "ckpt" / f"step-{titan_hf.STEP}" / "model-00001-of-00001.safetensors"))
    want = titan_hf.expected_hf(0, torch.float32)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_saving_the_last_step_again_replaces_it_whole(tmp_path):
    """A job restarted after its last step saves it again: the new folder replaces the old one only at the commit
    (a file the old folder had and the new one has not is gone)."""
    names = titan_hf.hf_names(titan_hf.model(0))
    assets = titan_hf.write_assets(str(tmp_path / "assets"), names, 3)
    titan_hf.manager(CheckpointManager, str(tmp_path), titan_hf.model(1), assets).save(titan_hf.STEP, last_step=True)
    titan_hf.manager(CheckpointManager, str(tmp_path), titan_hf.model(2), None).save(titan_hf.STEP, last_step=True)
    folder = str(tmp_path / "ckpt" / f"step-{titan_hf.STEP}")
    assert _files(folder) == ["model-00001-of-00001.safetensors"]
    assert titan_hf.folder_version(folder, (1, 2)) == 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"step-{titan_hf.STEP}"]


# ----------------------------------------------------------------------------------------- initial loads
def _loader(cls: Any, base: str, m: torch.nn.Module, path: str | None, assets: str | None = None) -> Any:
    """``cls``'s manager over ``m`` loading Hugging Face weights at its start (an empty folder): the folder
    ``path`` (``initial_load_path``), else the adapter's ``hf_assets_path`` (``assets``)."""
    config = cls.Config(
        enable=True, folder="ckpt", initial_load_path=path, initial_load_in_hf=True, initial_load_model_only=True
    )
    return titan_hf.build(config, base, m, assets)


def _model_state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("loader", [CheckpointManager, TitanManager], ids=["ours", "theirs"])
def test_our_last_step_loads_as_initial_weights_with_either_manager(tmp_path, loader):
    """Our bf16 last step into an fp32 model of other weights (cast, as Hub weights load): ours checks it against
    its manifests first; TorchTitan's own manager reads it too."""
    names = titan_hf.hf_names(titan_hf.model(0))
    assets = titan_hf.write_assets(str(tmp_path / "assets"), names, 2)
    titan_hf.manager(CheckpointManager, str(tmp_path / "job"), titan_hf.model(0), assets).save(5, last_step=True)
    target = titan_hf.model(7)
    assert _loader(loader, str(tmp_path / "next"), target, str(tmp_path / "job" / "ckpt" / "step-5")).load()
    for key, value in titan_hf.model(0).state_dict().items():
        got = target.state_dict()[key]
        assert got.dtype == torch.float32 and torch.equal(got, value.to(torch.bfloat16).float()), key


def _hub_folder(folder: str, seed: int = 3) -> str:
    """A folder as downloaded from the Hub: bf16 tensors in two files written by ``safetensors``, and the index
    (no nxd_ckpt manifest)."""
    os.makedirs(folder)
    hf = titan_hf.expected_hf(seed)
    names = list(hf)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: hf[n] for n in part}, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return folder


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 7)


def _header_past_the_file(path: str) -> None:
    """Rewrite the header (same length) so the last tensor's ``data_offsets`` point past the end of the file."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        begin, end = header[last]["data_offsets"]
        header[last]["data_offsets"] = [begin + 64, end + 64]
        encoded = json.dumps(header, separators=(",", ":")).encode()
        assert len(encoded) <= n
        f.seek(8)
        f.write(encoded + b" " * (n - len(encoded)))


def _wrong_shape(path: str) -> None:
    """The file rewritten with its first matrix flattened (the same bytes, another shape)."""
    tensors = load_file(path)
    first = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[first] = tensors[first].reshape(-1)
    save_file(tensors, path, metadata={"format": "pt"})


DAMAGE = {
    "truncated": (_truncate, r"point past the end.*; the shard is damaged"),
    "header_past_the_file": (_header_past_the_file, r"point past the end.*; the shard is damaged"),
    "wrong_shape": (_wrong_shape, r"has shape \[\d+\], but the model's is \[\d+, \d+\]"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_bad_hub_shard_is_refused_before_the_model_changes_naming_it(tmp_path, damage):
    folder = _hub_folder(str(tmp_path / "hub"))
    damaged = os.path.join(folder, "model-00002-of-00002.safetensors")
    fn, message = DAMAGE[damage]
    fn(damaged)
    target = titan_hf.model(7)
    before = _model_state(target)
    with pytest.raises((IntegrityError, ValueError), match=message) as e:
        _loader(CheckpointManager, str(tmp_path / "job"), target, folder).load()
    assert damaged in str(e.value)
    after = _model_state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_hub_folder_in_bf16_loads_into_an_fp32_model(tmp_path):
    """From ``initial_load_path``, and from ``model.hf_assets_path`` (the adapter's) when there is none."""
    folder = _hub_folder(str(tmp_path / "hub"), seed=3)
    for source, path, assets in (("initial_load_path", folder, None), ("hf_assets_path", None, folder)):
        target = titan_hf.model(7)
        assert _loader(CheckpointManager, str(tmp_path / source), target, path, assets).load()
        for key, value in titan_hf.model(3).state_dict().items():
            assert torch.equal(target.state_dict()[key], value.to(torch.bfloat16).float()), (source, key)


def test_a_flipped_byte_in_our_folder_is_named_by_its_manifest(tmp_path):
    """A flipped byte leaves every header valid: only the manifest's digest finds it, before the model changes."""
    titan_hf.manager(CheckpointManager, str(tmp_path / "job"), titan_hf.model(0), None).save(5, last_step=True)
    folder = str(tmp_path / "job" / "ckpt" / "step-5")
    shard = os.path.join(folder, "model-00001-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    target = titan_hf.model(7)
    before = _model_state(target)
    with pytest.raises(IntegrityError, match=r"model-00001-of-00001\.safetensors is corrupt: .*xxh3_64"):
        _loader(CheckpointManager, str(tmp_path / "next"), target, folder).load()
    after = _model_state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)
    shutil.copy(os.path.join(folder, "model-00001-of-00001.safetensors"), os.path.join(folder, "extra.safetensors"))
    with pytest.raises(IntegrityError, match=r"extra\.safetensors is not in the manifests"):
        _loader(CheckpointManager, str(tmp_path / "next"), target, folder).load()


# ----------------------------------------------------------------------------------------- FSDP2 on 2 ranks
def _sharded(seed: int) -> torch.nn.Module:
    m = titan_hf.model(seed)
    fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return m


def _fsdp_job(base: str, assets: str) -> None:
    """On each of 2 ranks: both managers save the last step of an FSDP2-sharded model (DTensor state); ours then
    loads it as initial weights into a sharded model of other weights."""
    warnings.simplefilter("ignore")
    for kind, cls in (("theirs", TitanManager), ("ours", CheckpointManager)):
        m = _sharded(0)
        assert all(type(v).__name__ == "DTensor" for v in m.state_dict().values())
        ckpt = titan_hf.manager(cls, os.path.join(base, kind), m, assets)
        ckpt.save(titan_hf.STEP, last_step=True)
        ckpt.close()
    target = _sharded(7)
    folder = os.path.join(base, "ours", "ckpt", f"step-{titan_hf.STEP}")
    assert _loader(CheckpointManager, os.path.join(base, f"next{dist.get_rank()}"), target, folder).load()
    for key, value in titan_hf.model(0).state_dict().items():
        assert torch.equal(target.state_dict()[key].full_tensor(), value.to(torch.bfloat16).float()), key


def test_fsdp2_state_on_two_ranks_is_written_as_torchtitan_writes_it(tmp_path):
    names = titan_hf.hf_names(titan_hf.model(0))
    assets = titan_hf.write_assets(str(tmp_path / "assets"), names, 3)  # files 1 and 3 on rank 1, 2 on rank 0
    run_on_ranks(_fsdp_job, 2, {"base": str(tmp_path / "job"), "assets": assets})
    folder = os.path.join("ckpt", f"step-{titan_hf.STEP}")
    theirs, ours = str(tmp_path / "job" / "theirs" / folder), str(tmp_path / "job" / "ours" / folder)
    assert_same_hf_folders(theirs, ours)
    assert titan_hf.folder_version(ours, (0,)) == 0
    ranks = sorted(os.listdir(os.path.join(ours, "nxd_ckpt")))
    assert ranks == ["manifest_rank_00000.json", "manifest_rank_00001.json"]


def _failing_rank_job(base: str, assets: str) -> None:
    """On each of 2 ranks: a last step saved, then saved again with rank 1's file writes failing: both ranks raise
    rank 1's error (no rank waits in a gather for it), and the first save stays."""
    from nxd_ckpt.format.integrity import ChecksummingStorage

    warnings.simplefilter("ignore")
    titan_hf.manager(CheckpointManager, base, _sharded(0), assets).save(titan_hf.STEP, last_step=True)
    if dist.get_rank() == 1:
        real = ChecksummingStorage.open_write

        def failing(self: Any, path: str) -> Any:
            if path.endswith(".safetensors"):
                raise OSError(28, "No space left on device (injected)")
            return real(self, path)

        ChecksummingStorage.open_write = failing  # type: ignore[method-assign]
    ckpt = titan_hf.manager(CheckpointManager, base, _sharded(1), assets, timeout_s=60)
    with pytest.raises(OSError, match="injected") as e:
        ckpt.save(titan_hf.STEP, last_step=True)
    assert getattr(e.value, "origin_rank", 1) == 1
    dist.barrier()
    assert titan_hf.folder_version(os.path.join(base, "ckpt", f"step-{titan_hf.STEP}"), (0, 1)) == 0


def test_a_rank_failing_to_write_fails_the_save_on_every_rank_and_the_previous_one_stays(tmp_path):
    assets = titan_hf.write_assets(str(tmp_path / "assets"), titan_hf.hf_names(titan_hf.model(0)), 3)
    run_on_ranks(_failing_rank_job, 2, {"base": str(tmp_path / "job"), "assets": assets}, timeout=180)


def test_a_job_restarted_after_its_hf_last_step_resumes_the_newest_dcp_step(tmp_path):
    """The Hugging Face ``step-N`` is the job's output (model only): a restart resumes the newest DCP step, where
    TorchTitan's own manager would pick ``step-N`` and fail to load it as DCP."""
    m = titan_hf.model(0)
    ckpt = titan_hf.manager(CheckpointManager, str(tmp_path), m, None, interval=2)
    at_step: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 6):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        at_step[step] = _model_state(m)
        ckpt.save(step, last_step=step == 5)
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-2", "step-4", "step-5"]
    assert INDEX in os.listdir(tmp_path / "ckpt" / "step-5")
    restarted = titan_hf.model(9)
    assert titan_hf.manager(CheckpointManager, str(tmp_path), restarted, None, interval=2).load()
    got = _model_state(restarted)
    assert all(torch.equal(got[k], at_step[4][k]) for k in got)
    with pytest.raises((Exception, CheckpointException), match=r"step-5"):
        titan_hf.manager(TitanManager, str(tmp_path), titan_hf.model(9), None, interval=2).load()
