"""nxd_ckpt.torchtitan.CheckpointManager, built from its Config as TorchTitan 0.3.0's trainer builds its checkpoint
manager, around TorchTitan's real ModelWrapper, optimizer and LR-scheduler containers and its StatefulDataLoader,
in one process with a gloo group of world size 1: bit-exact resume (sync and both async modes), keep_latest_k,
load_step, initial loads, exclude_from_loading, load_only, the model-only last save, verified loads with and
without fallback_to_verified, and checkpoints crossed both ways with TorchTitan's own DCP manager."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="needs the torchtitan extra (pip install 'nxd-ckpt[torchtitan]', Python >= 3.11)"
)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer import CheckpointManager as TitanManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from harness import titan_job
from harness.multiprocess import run_on_ranks
from nxd_ckpt.dcp import Stager
from nxd_ckpt.errors import CheckpointError, CheckpointTimeoutError, IntegrityError
from nxd_ckpt.torchtitan import CheckpointManager

pytestmark = pytest.mark.device_independent  # CPU state over gloo: runs once, in the CPU lane


@pytest.fixture(scope="module", autouse=True)
def _gloo_world_of_one() -> Iterator[None]:
    with titan_job.gloo_world_of_one():
        yield


class _Tokens(IterableDataset):
    """A deterministic stream of small batches' rows, one per rank (StatefulDataLoader fast-forwards it on
    resume)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        gen = torch.Generator().manual_seed(1234 + dist.get_rank())
        for _ in range(1000):
            yield torch.randn(8, generator=gen)


class _TrainState:
    """The trainer's own state entry (TorchTitan passes ``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class _Rig:
    """What TorchTitan's trainer builds before its checkpointer, in small, and the checkpointer built from
    ``config`` with the trainer's keyword arguments."""

    def __init__(self, config: Any, base_folder: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=20
        )
        rank, world = dist.get_rank(), dist.get_world_size()
        self.dataloader = ParallelAwareDataloader(_Tokens(), dp_rank=rank, dp_world_size=world, batch_size=2)
        self.train_state = _TrainState()
        self.checkpointer = config.build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=base_folder,
        )
        self._batches: Iterator[torch.Tensor] | None = None

    def train(self, steps: int, last_step: int = 0) -> None:
        """``steps`` training steps as TorchTitan's trainer runs them, a ``save`` call after each."""
        for _ in range(steps):
            if self._batches is None:
                self._batches = iter(self.dataloader)
            batch = next(self._batches)
            self.model(batch).square().mean().backward()
            titan_job.finish_step(self)
            self.train_state.ntokens_seen += batch.numel()
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == last_step)

    def snapshot(self) -> dict[str, Any]:
        """Everything a resume must restore, cloned: model, optimizer (FQN-keyed), LR, step, the next batch."""
        optim = self.optimizers.state_dict()
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim.items()},
            "lr": [g["lr"] for o in self.optimizers.optimizers for g in o.param_groups],
            "train_state": self.train_state.state_dict(),
        }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-exact equality of two snapshots."""
    assert a["train_state"] == b["train_state"]
    assert a["lr"] == b["lr"]
    _assert_same_values(a["model"], b["model"])
    _assert_same_values(a["optim"], b["optim"])


def _assert_same_values(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two flat state dicts hold the same keys and bit-identical values."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _ours(**fields: Any) -> CheckpointManager.Config:
    fields.setdefault("keep_latest_k", 0)
    return CheckpointManager.Config(enable=True, folder="ckpt", last_save_model_only=False, **fields)


def _theirs(**fields: Any) -> TitanManager.Config:
    fields.setdefault("keep_latest_k", 0)
    return TitanManager.Config(enable=True, folder="ckpt", last_save_model_only=False, **fields)


def _steps(base: Any) -> list[str]:
    return sorted(os.listdir(os.path.join(base, "ckpt")))


def _run_then_resume(base: str, saver: Any, loader: Any, saved_at: int = 3, total: int = 6) -> None:
    """A job saves step ``saved_at`` under ``saver`` (its interval), trains on while an async save writes, and
    stops before its next save; a second job with other weights resumes under ``loader`` and trains to ``total``:
    it ends bit-exactly as a run that never stopped."""
    first = _Rig(saver, base, seed=0)
    first.train(saved_at + 2)  # steps after the save change the state it is writing (async modes)
    first.checkpointer.close()
    first_after = _Rig(saver, base + "-unused", seed=0)  # the uninterrupted run, from the same start
    first_after.train(total)
    first_after.checkpointer.close()
    resumed = _Rig(loader, base, seed=1)
    assert resumed.checkpointer.load(step=-1) is True
    assert resumed.train_state.step == saved_at
    resumed.train(total - saved_at)
    resumed.checkpointer.close()
    _assert_same(resumed.snapshot(), first_after.snapshot())


@pytest.fixture
def stage_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the saves staged through ``nxd_ckpt.dcp.Stager`` (each entry: the stager's ``id``)."""
    calls: list[int] = []
    real = Stager.stage

    def counted(self: Stager, state_dict: Any) -> Any:
        calls.append(id(self))
        return real(self, state_dict)

    monkeypatch.setattr(Stager, "stage", counted)
    return calls


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_is_bit_exact(tmp_path, async_mode, stage_calls):
    config = _ours(interval=3, async_mode=async_mode)
    _run_then_resume(str(tmp_path / "job"), config, config)
    # the saving job saved step 3, the uninterrupted one steps 3 and 6, the resumed one step 6: each async save
    # was staged by its manager's one Stager (reused across saves)
    assert len(stage_calls) == (0 if async_mode == "disabled" else 4)
    assert len(set(stage_calls)) == (0 if async_mode == "disabled" else 3)
    names = _steps(tmp_path / "job")
    assert names == ["step-3", "step-6"]
    files = sorted(os.listdir(tmp_path / "job" / "ckpt" / "step-3"))
    assert files == [".metadata", "__0_0.distcp", "nxd_ckpt"]  # TorchTitan's layout, with our manifests beside


@pytest.mark.parametrize("direction", ["titan_to_ours", "ours_to_titan"])
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_checkpoints_cross_with_torchtitans_own_manager(tmp_path, direction, async_mode):
    ours, theirs = _ours(interval=3, async_mode=async_mode), _theirs(interval=3, async_mode=async_mode)
    saver, loader = (theirs, ours) if direction == "titan_to_ours" else (ours, theirs)
    _run_then_resume(str(tmp_path / "job"), saver, loader)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_keep_latest_k_keeps_the_newest_complete_steps(tmp_path, async_mode):
    base = tmp_path / "job"
    os.makedirs(base / "ckpt" / "step-0")  # an interrupted save older than every kept step: deleted too
    rig = _Rig(_ours(interval=1, keep_latest_k=2, async_mode=async_mode), str(base), seed=0)
    rig.train(5)
    rig.checkpointer.close()
    assert _steps(base) == ["step-4", "step-5"]
    resumed = _Rig(_ours(), str(base), seed=1)
    assert resumed.checkpointer.load() and resumed.train_state.step == 5


def test_load_step_loads_that_step(tmp_path):
    rig = _Rig(_ours(interval=2), str(tmp_path), seed=0)
    rig.train(4)
    rig.checkpointer.close()
    resumed = _Rig(_ours(load_step=2), str(tmp_path), seed=1)
    assert resumed.checkpointer.load(step=2) and resumed.train_state.step == 2
    with pytest.raises(FileNotFoundError, match="load_step=3 not found"):
        resumed.checkpointer.load(step=3)


def test_exclude_from_loading_and_load_only(tmp_path):
    rig = _Rig(_ours(interval=2), str(tmp_path), seed=0)
    rig.train(2)
    rig.checkpointer.close()
    expected = rig.snapshot()
    resumed = _Rig(_ours(exclude_from_loading=["train_state"], load_only=True), str(tmp_path), seed=1)
    assert resumed.checkpointer.load()
    assert resumed.train_state.step == 0  # excluded
    assert all(torch.equal(v, expected["model"][k]) for k, v in resumed.model.state_dict().items())
    resumed.train(2)
    assert _steps(tmp_path) == ["step-2"]  # load_only: nothing saved


def test_initial_load_path_is_model_only(tmp_path):
    source = _Rig(_ours(interval=2), str(tmp_path / "pretrain"), seed=0)
    source.train(2)
    source.checkpointer.close()
    initial = str(tmp_path / "pretrain" / "ckpt" / "step-2")
    fresh = _Rig(_ours(initial_load_path=initial), str(tmp_path / "finetune"), seed=1)
    assert fresh.checkpointer.load()
    assert all(torch.equal(v, source.model.state_dict()[k]) for k, v in fresh.model.state_dict().items())
    untouched = _Rig(_ours(), str(tmp_path / "other"), seed=1).optimizers.state_dict()
    assert fresh.train_state.step == 0  # model only: optimizer and train state as built
    _assert_same_values(fresh.optimizers.state_dict(), untouched)
    assert not _Rig(_ours(), str(tmp_path / "fresh"), seed=1).checkpointer.load()  # nothing anywhere: fresh start


def test_last_save_is_model_only_in_export_dtype(tmp_path):
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=100, export_dtype="bfloat16")
    rig = _Rig(config, str(tmp_path), seed=0)
    rig.train(3, last_step=3)
    rig.checkpointer.close()
    model = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in rig.model.state_dict().items()}
    dcp.load(model, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt" / "step-3")))  # stock DCP reads it
    assert all(torch.equal(v, rig.model.state_dict()[k].to(torch.bfloat16)) for k, v in model.items())
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step-3")).read_metadata()
    assert set(metadata.state_dict_metadata) == set(model)  # the model only: no optimizer, no train state


def _damage_newest(base: Any, step: int) -> str:
    """Flip a byte inside the tensor data of ``step``'s rank file (torch.load would not notice)."""
    path = os.path.join(base, "ckpt", f"step-{step}", "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    return path


def test_a_damaged_step_is_detected_and_fallback_loads_the_newest_intact(tmp_path, caplog):
    rig = _Rig(_ours(interval=2), str(tmp_path), seed=0)
    rig.train(2)
    at_two = rig.snapshot()
    rig.train(2)
    rig.checkpointer.close()
    damaged = _damage_newest(tmp_path, 4)
    with pytest.raises(IntegrityError, match=r"step-4 is damaged.*__0_0\.distcp.*fallback_to_verified"):
        _Rig(_ours(), str(tmp_path), seed=1).checkpointer.load()
    resumed = _Rig(_ours(fallback_to_verified=True), str(tmp_path), seed=1)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        assert resumed.checkpointer.load()
    assert "skipping damaged checkpoint step-4" in caplog.text and os.path.basename(damaged) in caplog.text
    _assert_same(resumed.snapshot(), at_two)


def test_a_truncated_step_torchtitans_manager_wrote_is_skipped_with_fallback(tmp_path):
    rig = _Rig(_theirs(interval=2), str(tmp_path), seed=0)
    rig.train(2)
    at_two = rig.snapshot()
    rig.train(2)
    rig.checkpointer.close()
    path = tmp_path / "ckpt" / "step-4" / "__0_0.distcp"
    os.truncate(path, os.path.getsize(path) // 2)  # still "valid" for TorchTitan: .metadata is there
    with pytest.raises(IntegrityError, match=r"step-4 is damaged.*__0_0\.distcp is truncated"):
        _Rig(_ours(), str(tmp_path), seed=1).checkpointer.load()
    resumed = _Rig(_ours(fallback_to_verified=True), str(tmp_path), seed=1)
    assert resumed.checkpointer.load()
    _assert_same(resumed.snapshot(), at_two)


def test_the_config_checks_last_save_in_hf_and_refuses_unsupported_fields():
    with pytest.raises(ValueError, match="last_save_in_hf requires last_save_model_only=True"):
        CheckpointManager.Config(enable=True, last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ValueError, match="last_save_in_hf writes a local folder or s3://"):
        CheckpointManager.Config(enable=True, last_save_in_hf=True, folder="gs://bucket/ckpt")
    for folder in ("checkpoint", "s3://bucket/run/ckpt"):  # TorchTitan's own Config refuses the s3:// one
        assert CheckpointManager.Config(enable=True, last_save_in_hf=True, folder=folder).last_save_in_hf
    with pytest.raises(ValueError, match="last_save_in_hf is True, but sd_adapter is not provided"):
        CheckpointManager.Config(enable=True, last_save_in_hf=True).build(
            dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
        )
    with pytest.raises(ValueError, match="Invalid async_mode"):
        CheckpointManager.Config(enable=True, async_mode="sometimes")
    with pytest.raises(ValueError, match="host_memory_budget='lots' is not a size"):
        CheckpointManager.Config(enable=True, host_memory_budget="lots")
    with pytest.raises(ValueError, match="device_snapshot_budget"):
        CheckpointManager.Config(enable=True, device_snapshot_budget=-1)


def test_the_host_memory_budget_is_honoured_and_maybe_wait_for_staging_waits_for_the_stager(tmp_path, stage_calls):
    """Within the budget async saves stage through the Stager and resume bit-exactly; a rank whose state exceeds
    ``host_memory_budget`` is refused by the save, and the previous step stays."""
    rig = _Rig(_ours(interval=2, async_mode="async", host_memory_budget="1MiB"), str(tmp_path), seed=0)
    assert rig.checkpointer.stager.host_memory_budget == 1 << 20
    rig.train(2)
    assert rig.checkpointer.staging_future is not None and len(stage_calls) == 1
    rig.checkpointer.maybe_wait_for_staging()
    assert rig.checkpointer.staging_future is None
    rig.checkpointer.maybe_wait_for_saving()
    at_two = rig.snapshot()
    rig.checkpointer.close()
    tight = _Rig(_ours(interval=2, async_mode="async_with_pinned_mem", host_memory_budget=1024), str(tmp_path), seed=0)
    with pytest.raises(CheckpointError, match="more than host_memory_budget=1024"):
        tight.train(2)
    tight.checkpointer.close()
    resumed = _Rig(_ours(), str(tmp_path), seed=1)
    assert resumed.checkpointer.load()
    _assert_same(resumed.snapshot(), at_two)


def test_it_is_a_checkpoint_config_the_trainer_builds():
    """TorchTitan's trainer declares ``checkpoint: BaseCheckpointManager.Config`` and calls its ``build`` (importing
    the trainer itself needs triton, absent on CPU)."""
    config = CheckpointManager.Config(enable=True, async_mode="async")
    assert isinstance(config, BaseCheckpointManager.Config) and type(config)._owner is CheckpointManager
    disabled = CheckpointManager.Config().build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert isinstance(disabled, CheckpointManager) and disabled.save(5) is False and disabled.load() is False


def test_an_async_save_that_fails_raises_at_the_next_wait_and_the_previous_step_stays(tmp_path, monkeypatch):
    rig = _Rig(_ours(interval=2, async_mode="async"), str(tmp_path), seed=0)
    rig.train(2)
    rig.checkpointer.maybe_wait_for_saving()
    at_two = rig.snapshot()

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr("nxd_ckpt.save.commit.complete_folder", disk_full)
    rig.train(2)  # step 4's save starts in the background and fails there
    with pytest.raises((CheckpointException, OSError), match="No space left on device"):
        rig.checkpointer.close()  # waits for the save in flight: its error reaches the caller
    rig.checkpointer.maybe_wait_for_saving()  # raised once
    assert [n for n in _steps(tmp_path) if not n.startswith(".")] == ["step-2"]  # + step-4's hidden staging
    resumed = _Rig(_ours(), str(tmp_path), seed=1)
    assert resumed.checkpointer.load()
    _assert_same(resumed.snapshot(), at_two)


def _two_ranks(base: str) -> None:
    """On each of 2 ranks: our manager saves asynchronously at step 3; TorchTitan's own manager and ours each
    resume from it and train to step 6, bit-exactly as the run that never stopped."""
    warnings.simplefilter("ignore")
    ours = _ours(interval=3, async_mode="async")
    first = _Rig(ours, base, seed=0)
    first.train(3)
    first.checkpointer.close()
    reference = _Rig(_ours(interval=100), base + "-reference", seed=0)
    reference.train(6)
    for loader in (_theirs(interval=100), _ours(interval=100)):
        resumed = _Rig(loader, base, seed=1)
        assert resumed.checkpointer.load() and resumed.train_state.step == 3
        resumed.train(3)
        resumed.checkpointer.close()
        _assert_same(resumed.snapshot(), reference.snapshot())


def test_two_ranks_save_async_and_resume_with_either_manager(tmp_path):
    run_on_ranks(_two_ranks, 2, {"base": str(tmp_path / "job")})
    assert sorted(os.listdir(tmp_path / "job" / "ckpt" / "step-3")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "nxd_ckpt",
    ]


def test_a_staging_that_never_ends_raises_at_maybe_wait_for_staging_naming_the_rank(tmp_path):
    """``maybe_wait_for_staging`` waits under the deadline (``timeout_s``), not forever."""
    rig = _Rig(_ours(interval=2, async_mode="async", timeout_s=0.2), str(tmp_path), seed=0)
    rig.checkpointer.staging_future = Future()  # host copies that never arrive
    with pytest.raises(CheckpointTimeoutError, match=r"staging an async TorchTitan checkpoint on rank 0: waited 0.2 s"):
        rig.checkpointer.maybe_wait_for_staging()
    rig.checkpointer.close()


def _flip_metadata(base: str, step: int) -> str:
    """Flip a byte in the middle of ``step``'s ``.metadata``."""
    path = os.path.join(base, "ckpt", f"step-{step}", ".metadata")
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(bytes(data))
    return path


def _damaged_metadata_on_two_ranks(base: str) -> None:
    """On each of 2 ranks: steps 2 and 4 saved; step 4's ``.metadata`` damaged. Without fallback the resume fails
    with IntegrityError naming it; with ``fallback_to_verified`` step 2 loads, bit-exactly."""
    warnings.simplefilter("ignore")
    rig = _Rig(_ours(interval=2), base, seed=0)
    rig.train(2)
    at_two = rig.snapshot()
    rig.train(2)
    rig.checkpointer.close()
    dist.barrier()
    if dist.get_rank() == 0:
        _flip_metadata(base, 4)
    dist.barrier()
    with pytest.raises(IntegrityError, match=r"step-4 is damaged.*step-4/\.metadata is corrupt"):
        _Rig(_ours(), base, seed=1).checkpointer.load()
    resumed = _Rig(_ours(fallback_to_verified=True), base, seed=1)
    assert resumed.checkpointer.load()
    _assert_same(resumed.snapshot(), at_two)


def test_a_damaged_metadata_on_two_ranks_falls_back_to_the_newest_intact_step(tmp_path):
    run_on_ranks(_damaged_metadata_on_two_ranks, 2, {"base": str(tmp_path / "job")})


def _steps_two_and_four(base: str) -> tuple[dict[str, Any], dict[str, Any]]:
    rig = _Rig(_ours(interval=2), base, seed=0)
    rig.train(2)
    at_two = rig.snapshot()
    rig.train(2)
    at_four = rig.snapshot()
    rig.checkpointer.close()
    return at_two, at_four


def test_a_briefly_missing_file_is_looked_at_again_not_taken_for_damage(tmp_path, caplog):
    """A file missing for a moment (a transient ENOENT on NFS): the newest step still loads, no fallback."""
    _, at_four = _steps_two_and_four(str(tmp_path))
    path = tmp_path / "ckpt" / "step-4" / "__0_0.distcp"
    hidden = tmp_path / "elsewhere.distcp"
    os.rename(path, hidden)
    back = threading.Timer(0.3, os.rename, (hidden, path))
    back.start()
    resumed = _Rig(_ours(fallback_to_verified=True), str(tmp_path), seed=1)
    with caplog.at_level(logging.WARNING, logger="nxd_ckpt"):
        assert resumed.checkpointer.load()
    back.join()
    assert "a file is missing" in caplog.text and "skipping damaged checkpoint" not in caplog.text
    _assert_same(resumed.snapshot(), at_four)


def test_a_file_still_missing_after_the_rechecks_is_damage(tmp_path):
    at_two, _ = _steps_two_and_four(str(tmp_path))
    os.remove(tmp_path / "ckpt" / "step-4" / "__0_0.distcp")
    with pytest.raises(IntegrityError, match=r"step-4 is damaged.*__0_0\.distcp"):
        _Rig(_ours(), str(tmp_path), seed=1).checkpointer.load()
    resumed = _Rig(_ours(fallback_to_verified=True), str(tmp_path), seed=1)
    assert resumed.checkpointer.load()
    _assert_same(resumed.snapshot(), at_two)
