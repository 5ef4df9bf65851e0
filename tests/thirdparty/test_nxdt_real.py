"""NxDT 2.26's real Lightning ``NLPCheckpointIO`` running unchanged on nxd_ckpt through ``nxd_ckpt.compat.install()``
(with NxD 2.29's real modules patched; stubs: Neuron SDK, NeMo and NxDT's utils package helpers, see
harness.thirdparty). Its save strips ``-vN``, splits Lightning's dict into model, optimizer and user
content; its ``remove_checkpoint`` calls ``g_iostate.submit_remove`` while async saves are in flight; its load
fills empty dicts; the tags are complete NxD tags that NxD's own load reads and ``nxd-ckpt verify`` passes."""

from __future__ import annotations

import os

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

pytestmark = pytest.mark.xla
pytest.importorskip("torch_xla", reason="needs torch_xla: runs in the XLA lane (NXD_CKPT_LANES=xla)")


def _lightning_checkpoint(model, opt, sched, step: int) -> dict:
    """What Lightning's ``_CheckpointConnector.dump_checkpoint`` hands the CheckpointIO (the parts NxDT reads)."""
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hyper_parameters": {"cfg": {"wrap_with_zero": False}},
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_nlp_checkpoint_io_saves_removes_and_loads_through_nxd_ckpt(
    nxd_compat, nlp_checkpoint_io, tmp_path, async_save
):
    import torch_xla

    ckpt_dir = str(tmp_path / "checkpoints")
    io = nlp_checkpoint_io(async_save=async_save)
    model, opt, sched = make_training(seed=1, device=torch_xla.device())
    saved = {}
    for step in (2, 4):
        train_steps(model, opt, sched, 2, seed=step)
        ckpt = _lightning_checkpoint(model, opt, sched, step)
        saved[step] = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in model.state_dict().items()}
        io.save_checkpoint(ckpt, f"{ckpt_dir}/step={step}-v1.ckpt", save_type_xser=True)  # '-v1' is stripped
    assert nxd_compat.g_iostate is nxd.g_iostate
    io.remove_checkpoint(f"{ckpt_dir}/step=2.ckpt")  # with async saves, step=4 may still be writing
    io.teardown()  # nxd.finalize_checkpoint()

    assert nxd.list_checkpoint_tags(ckpt_dir) == ["step=4.ckpt"]
    assert sorted(os.listdir(ckpt_dir)) == [".nxd-tags.json", "step=4.ckpt"]  # + the tag index of latest
    assert nxd.verify(ckpt_dir, "step=4.ckpt").ok

    loaded = io.load_checkpoint(f"{ckpt_dir}/step=4.ckpt", load_type_xser=True)
    assert_state_equal(loaded["state_dict"], saved[4])
    assert_state_equal(loaded["optimizer_states"][0], opt.state_dict())
    assert loaded["global_step"] == 4 and loaded["lr_schedulers"] == [sched.state_dict()]
    assert loaded["hyper_parameters"] == {"cfg": {"wrap_with_zero": False}}

    model2, opt2, sched2 = make_training(seed=9, device=torch_xla.device())
    model2.load_state_dict(loaded["state_dict"])
    opt2.load_state_dict(loaded["optimizer_states"][0])
    sched2.load_state_dict(loaded["lr_schedulers"][0])
    assert train_steps(model2, opt2, sched2, 2, seed=5) == train_steps(model, opt, sched, 2, seed=5)

    weights_only = nlp_checkpoint_io(weight_init_only=True).load_checkpoint(f"{ckpt_dir}/step=4.ckpt", True)
    assert "optimizer_states" not in weights_only
    assert_state_equal(weights_only["state_dict"], saved[4])


def test_nxd_original_load_reads_what_nlp_checkpoint_io_wrote(nxd_compat, nlp_checkpoint_io, tmp_path):
    """With compat uninstalled, NxD's own load_checkpoint reads the tag NxDT wrote through nxd_ckpt."""
    import torch_xla

    from nxd_ckpt import compat

    model, opt, sched = make_training(seed=1, device=torch_xla.device())
    train_steps(model, opt, sched, 2, seed=1)
    io = nlp_checkpoint_io(async_save=True)
    io.save_checkpoint(_lightning_checkpoint(model, opt, sched, 2), f"{tmp_path}/step=2.ckpt", save_type_xser=True)
    io.teardown()
    compat.uninstall()
    target_model: dict = {}
    target_opt: dict = {}
    content = nxd_compat.load_checkpoint(str(tmp_path), "step=2.ckpt", model=target_model, optimizer=target_opt)
    assert content["global_step"] == 2
    assert_state_equal(target_model, model.state_dict())
    assert_state_equal(target_opt, opt.state_dict())
