"""Stock PyTorch Lightning jobs on 2 real ranks with NxdCheckpointIO: save, stop, resume from "last", exactly.

Each rank runs three Trainers, once with sync saves and ``save_last=True``, once with async saves and
``save_last="link"`` in one process (the job's process group stays up between them, as under torchrun):
A trains 8 steps without checkpoints; B trains with ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2,
save_last=True)`` and is stopped by an exception at step 5 (its last checkpoint is step 4); C is a fresh module
resumed with ``fit(ckpt_path="last")`` to step 8. C's losses and final weights must equal A's bit for bit, and the
directory must hold exactly what Lightning's retention keeps, each tag complete (``done``) and verified.

The CPU lane runs ``NxdDDPStrategy`` (gloo DDP on CPU); the XLA lane runs ``NxdXLAStrategy`` on the XLA CPU device
(processes started as torchrun starts them; each rank sees the same batches, since torch_xla's gradient reduction
does not cross processes on XLA:CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

import nxd_ckpt as nxd
from harness.multiprocess import run_on_ranks
from nxd_ckpt import cli
from nxd_ckpt.format.describe import describe
from nxd_ckpt.storage import storage_for

pl = pytest.importorskip("pytorch_lightning")

WORLD = 2
STEPS = 8
STOP_AT = 5  # B raises before this step; its newest checkpoint is the one after step 4
XLA_LANE = os.environ.get("NXD_CKPT_TEST_LANE") == "xla"
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "nxd-ckpt-lightning-test"}  # Lightning then reads ranks as from torchrun


class Tiny(pl.LightningModule):
    """An MLP with Adam and a step LR schedule; each step's batch depends only on the step (and the rank in DDP)."""

    def __init__(self, per_rank_data: bool) -> None:
        super().__init__()
        self.save_hyperparameters({"cfg": {"wrap_with_zero": False}, "per_rank_data": per_rank_data})
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.losses: dict[int, torch.Tensor] = {}
        self.devices: set[str] = set()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        rank = self.global_rank if self.hparams["per_rank_data"] else 0
        g = torch.Generator().manual_seed(1000 * self.global_step + rank)
        x, y = torch.randn(4, 8, generator=g).to(self.device), torch.randn(4, 4, generator=g).to(self.device)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss
        self.devices.add(loss.device.type)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.losses[self.global_step - 1] = self.losses[self.global_step - 1].detach().cpu().clone()

    def configure_optimizers(self) -> object:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(100.0)), batch_size=1)


class Stop(pl.Callback):
    """Stops training with an exception before step ``at`` (a crash that Lightning sees)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: object, *args: object) -> None:
        if trainer.global_step == self.at:
            raise KeyError(f"stop at step {self.at}")


def _recording_io(async_save: bool) -> object:
    """NxdCheckpointIO keeping the report of every save it made (``last_report`` after each)."""
    from nxd_ckpt.lightning import NxdCheckpointIO

    class Recording(NxdCheckpointIO):
        def __init__(self) -> None:
            super().__init__(use_xser=True, async_save=async_save)
            self.reports: list = []

        def save_checkpoint(self, *args: object, **kwargs: object) -> None:
            super().save_checkpoint(*args, **kwargs)
            self.reports.append(self.last_report)

    return Recording()


def _trainer(strategy_kind: str, async_save: bool, callbacks: list, checkpoints: bool) -> pl.Trainer:
    from nxd_ckpt.lightning import NxdDDPStrategy, NxdXLAStrategy

    if strategy_kind == "xla":
        hw = {"devices": 1, "num_nodes": WORLD, "strategy": NxdXLAStrategy()}
    else:
        hw = {"accelerator": "cpu", "devices": WORLD, "strategy": NxdDDPStrategy()}
    return pl.Trainer(
        max_steps=STEPS,
        callbacks=callbacks,
        plugins=[_recording_io(async_save)],
        enable_checkpointing=checkpoints,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **hw,
    )


def _checkpointing(ckpt_dir: str, save_last: bool | str) -> pl.callbacks.ModelCheckpoint:
    return pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=save_last
    )


def _weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _lightning_job(ckpt_dir: str, async_save: bool, strategy_kind: str) -> None:
    """On every rank: A (uninterrupted), B (stopped at step 5), C (resumed from "last"), then compare. Sync saves
    use ``save_last=True`` (last.ckpt saved again each time), async ones ``save_last="link"`` (a symbolic link)."""
    save_last = "link" if async_save else True
    per_rank_data = strategy_kind == "ddp"
    a = Tiny(per_rank_data)
    _trainer(strategy_kind, async_save, [], checkpoints=False).fit(a)
    assert sorted(a.losses) == list(range(STEPS))

    b = Tiny(per_rank_data)
    callbacks = [_checkpointing(ckpt_dir, save_last), Stop(STOP_AT)]
    trainer_b = _trainer(strategy_kind, async_save, callbacks, checkpoints=True)
    with pytest.raises(KeyError, match="stop at step 5"):
        trainer_b.fit(b)
    assert sorted(b.losses) == list(range(STOP_AT))
    reports = trainer_b.strategy.checkpoint_io.reports
    assert reports and reports[0].tag == "epoch=0-step=2.ckpt"
    if async_save and strategy_kind == "ddp":  # CPU state: the strategy prepared the first save's staging memory
        state_bytes = 3 * sum(p.numel() * p.element_size() for p in b.parameters())  # weights + Adam's moments
        first = reports[0].staging_allocated_bytes  # without the preparation: at least state_bytes
        assert first <= 64, (first, state_bytes)  # only scalars of Lightning's callback state, new at every save

    c = Tiny(per_rank_data)
    trainer = _trainer(strategy_kind, async_save, [_checkpointing(ckpt_dir, save_last)], checkpoints=True)
    trainer.fit(c, ckpt_path="last")
    assert sorted(c.losses) == list(range(4, STEPS)), "resumed from the step-4 checkpoint"
    assert a.devices == b.devices == c.devices == {"xla" if strategy_kind == "xla" else "cpu"}
    for step in range(4, STEPS):
        assert torch.equal(c.losses[step], a.losses[step]), f"loss at step {step} differs from the uninterrupted run"
    for name, value in _weights(a).items():
        assert torch.equal(_weights(c)[name], value), f"{name} differs from the uninterrupted run"
    torch.distributed.barrier()  # rank 0 deletes (on its writer, finished by its teardown): wait for it
    _check_directory(ckpt_dir)
    assert os.path.islink(os.path.join(ckpt_dir, "last.ckpt")) == (save_last == "link")


def _check_directory(ckpt_dir: str) -> None:
    """Lightning's top-2 (by step) plus last, each a complete NxD-layout tag that verifies, split as NxDT does."""
    kept = {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"}
    assert set(nxd.list_checkpoint_tags(ckpt_dir)) == kept
    assert {n for n in os.listdir(ckpt_dir) if not n.startswith(".")} == kept
    storage = storage_for(ckpt_dir)
    for tag in kept:
        assert os.path.exists(os.path.join(ckpt_dir, tag, "done"))
        assert nxd.verify(ckpt_dir, tag).ok
        assert set(describe(storage, tag).saved_items) == {"model", "optimizer", "user_content"}
    assert cli.main(["verify", ckpt_dir, "--all", "--quick"]) == 0  # the command line agrees
    content = nxd.Checkpoint(storage, "last.ckpt").read("user_content")
    assert content["global_step"] == STEPS
    assert "state_dict" not in content and "optimizer_states" not in content
    assert {"loops", "callbacks", "lr_schedulers", "hyper_parameters", "epoch"} <= set(content)


def _refuses_a_one_rank_save(tmp: str) -> None:
    """Lightning's stock strategies call the CheckpointIO on rank 0 only: refused at once, not a hang."""
    from nxd_ckpt.lightning import NxdCheckpointIO

    with pytest.raises(RuntimeError, match="NxdDDPStrategy"):
        NxdCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, os.path.join(tmp, "x.ckpt"))


def _ddp_rank(tmp: str) -> None:
    _refuses_a_one_rank_save(tmp)
    for mode in ("sync", "async"):
        _lightning_job(os.path.join(tmp, mode), mode == "async", "ddp")


@pytest.mark.skipif(XLA_LANE, reason="the XLA lane runs test_lightning_xla_resumes_exactly")
def test_lightning_ddp_resumes_exactly(tmp_path):
    """Sync saves, then async saves (one pair of processes for both: Lightning's start-up is most of the time)."""
    run_on_ranks(_ddp_rank, WORLD, {"tmp": str(tmp_path)}, env=TORCHRUN_ENV, timeout=480)


def _xla_rank(tmp: str) -> None:
    import torch_xla

    torch_xla.device()  # the XLA runtime first (see tests/conftest.py)
    for mode in ("sync", "async"):
        _lightning_job(os.path.join(tmp, mode), mode == "async", "xla")


@pytest.mark.xla
def test_lightning_xla_resumes_exactly(tmp_path):
    run_on_ranks(_xla_rank, WORLD, {"tmp": str(tmp_path)}, env=TORCHRUN_ENV, timeout=480)


def _xla_single_rank_snapshot_ahead(tmp: str) -> None:
    import torch_xla

    from harness.xla_metrics import xla_graph_compiles
    from nxd_ckpt.device import snapshot
    from nxd_ckpt.lightning import NxdCheckpointIO, NxdXLAStrategy

    torch_xla.device()
    taken: list[int] = []
    real_warm = snapshot.warm

    def recording_warm(*args: object, **kwargs: object) -> int:
        taken.append(real_warm(*args, **kwargs))
        return taken[-1]

    class Counting(NxdCheckpointIO):
        compiled: list[int] = []

        def save_checkpoint(self, *args: object, **kwargs: object) -> None:
            before = xla_graph_compiles()
            super().save_checkpoint(*args, **kwargs)
            self.compiled.append(xla_graph_compiles() - before)

    snapshot.warm = recording_warm
    try:
        io = Counting(use_xser=True, async_save=True)
        trainer = pl.Trainer(
            max_steps=4,
            callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1)],
            plugins=[io],
            devices=1,
            num_nodes=1,
            strategy=NxdXLAStrategy(),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(Tiny(per_rank_data=False))
    finally:
        snapshot.warm = real_warm
    # XLAPrecision runs mark_step right after the step, so the strategy's prepare_async_save finds no pending graph
    assert len(taken) == 1 and taken[0] > 0, taken
    assert io.compiled == [0, 0], io.compiled  # the first save's snapshot graph was compiled ahead


@pytest.mark.xla
def test_lightning_xla_on_one_rank_takes_the_device_snapshot_ahead_of_the_first_save(tmp_path):
    run_on_ranks(_xla_single_rank_snapshot_ahead, 1, {"tmp": str(tmp_path)}, env=TORCHRUN_ENV, timeout=300)
