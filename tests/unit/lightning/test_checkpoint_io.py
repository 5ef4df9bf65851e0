"""NxdCheckpointIO in one process with the real pytorch-lightning: path mapping, NxDT's split of Lightning's dict,
round trips through a Trainer, ZeRO-1 from the config, weight_init_only, and removals behind async saves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.format.describe import describe
from nxd_ckpt.lightning import (
    checkpoint_location,
    classes_for,
    lightning_package,
    split_checkpoint,
    zero1_from_config,
)
from nxd_ckpt.storage import storage_for

pytestmark = pytest.mark.device_independent  # Lightning's checkpoint plumbing: runs once, in the CPU lane

pl = pytest.importorskip("pytorch_lightning")


class Tiny(pl.LightningModule):
    def __init__(self, wrap_with_zero: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters({"cfg": {"wrap_with_zero": wrap_with_zero}})
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> object:
        opt = torch.optim.Adam(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)


def _trained(io: object, wrap_with_zero: bool = False) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        plugins=[io],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(wrap_with_zero))
    return trainer


def _io(**kwargs: object) -> object:
    from nxd_ckpt.lightning import NxdCheckpointIO

    return NxdCheckpointIO(**kwargs)


def _assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/ck/epoch=0-step=4.ckpt", ("/ck", "epoch=0-step=4.ckpt")),
        ("/ck/last-v1.ckpt", ("/ck", "last.ckpt")),
        ("/ck/epoch=1-step=9-v12.ckpt", ("/ck", "epoch=1-step=9.ckpt")),
        ("/my-vol/run/val-vloss=0.50.ckpt", ("/my-vol/run", "val-vloss=0.50.ckpt")),  # NxDT would cut at "-v"
        ("s3://bucket/run/last.ckpt", ("s3://bucket/run", "last.ckpt")),
        ("last.ckpt", (".", "last.ckpt")),
        ("/ck/step_7", ("/ck", "step_7")),
    ],
)
def test_lightning_paths_map_to_a_directory_and_a_tag(path, expected):
    assert checkpoint_location(path) == expected


def test_the_version_counter_can_be_kept():
    assert checkpoint_location("/ck/last-v1.ckpt", strip_version=False) == ("/ck", "last-v1.ckpt")
    assert _io(strip_version_suffix=False).location("/ck/last-v1.ckpt") == ("/ck", "last-v1.ckpt")


def test_split_is_nxdts_state_dict_optimizer_states_0_and_the_rest():
    """NxDT's NLPCheckpointIO pops state_dict -> model and optimizer_states[0] -> optimizer; the rest is content."""
    trainer = _trained(_io())
    dumped = trainer._checkpoint_connector.dump_checkpoint()
    model, optimizer, content = split_checkpoint(dumped)
    assert model is dumped["state_dict"]
    assert optimizer is dumped["optimizer_states"][0]
    assert set(content) == set(dumped) - {"state_dict", "optimizer_states"}
    assert "state_dict" in dumped and "optimizer_states" in dumped  # Lightning's dict is left alone


def test_more_than_one_optimizer_is_refused_and_none_is_kept():
    with pytest.raises(ValueError, match="2 optimizers.*one optimizer"):
        split_checkpoint({"state_dict": {}, "optimizer_states": [{}, {}]})
    assert split_checkpoint({"state_dict": {}, "optimizer_states": []})[1:] == (None, {"optimizer_states": []})
    assert split_checkpoint({"state_dict": {}, "epoch": 1})[1:] == (None, {"epoch": 1})  # save_weights_only
    with pytest.raises(KeyError, match="state_dict"):
        split_checkpoint({"epoch": 1})


def test_a_trainer_checkpoint_round_trips(tmp_path):
    io = _io(use_xser=True)
    trainer = _trained(io)
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    trainer.save_checkpoint(path)
    dumped = trainer._checkpoint_connector.dump_checkpoint()
    assert os.path.isfile(os.path.join(path, "done"))
    assert set(describe(storage_for(tmp_path), "epoch=0-step=2.ckpt").saved_items) == {
        "model",
        "optimizer",
        "user_content",
    }
    assert nxd.verify(str(tmp_path), "epoch=0-step=2.ckpt").ok
    _assert_same(dumped, io.load_checkpoint(path))


def test_weights_only_saves_and_weight_init_only_loads_hold_no_optimizer(tmp_path):
    trainer = _trained(_io())
    path = str(tmp_path / "weights.ckpt")
    trainer.save_checkpoint(path, weights_only=True)
    assert "optimizer" not in describe(storage_for(tmp_path), "weights.ckpt").saved_items
    loaded = _io().load_checkpoint(path)
    assert "optimizer_states" not in loaded and set(loaded["state_dict"]) == {"net.weight", "net.bias"}

    full = str(tmp_path / "full.ckpt")
    trainer.save_checkpoint(full)
    loaded = _io(weight_init_only=True).load_checkpoint(full)
    assert "optimizer_states" not in loaded and loaded["global_step"] == 2
    _assert_same(trainer.lightning_module.state_dict(), loaded["state_dict"])


def test_zero1_comes_from_nxdts_config_or_the_constructor(tmp_path):
    assert zero1_from_config({"hyper_parameters": {"cfg": {"wrap_with_zero": True}}})
    assert not zero1_from_config({"hyper_parameters": {"cfg": {}}})
    assert not zero1_from_config({"hyper_parameters": "not a mapping"})
    assert not zero1_from_config({})
    _trained(_io(), wrap_with_zero=True).save_checkpoint(str(tmp_path / "z.ckpt"))
    assert describe(storage_for(tmp_path), "z.ckpt").metadata.zero1
    _trained(_io(zero1=False), wrap_with_zero=True).save_checkpoint(str(tmp_path / "plain.ckpt"))
    assert not describe(storage_for(tmp_path), "plain.ckpt").metadata.zero1


def test_storage_options_are_refused_with_the_alternative(tmp_path):
    with pytest.raises(TypeError, match="save_options"):
        _io().save_checkpoint({"state_dict": {}}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})


def test_bad_nxd_options_fail_when_the_checkpoint_io_is_built():
    """Not at the first save, minutes into training: unknown names, names the CheckpointIO sets, bad values."""
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['timout'\]"):
        _io(save_options={"timout": 5})
    with pytest.raises(TypeError, match=r"\['use_xser'\] set by NxdCheckpointIO itself"):
        _io(save_options={"use_xser": False})
    with pytest.raises(ValueError, match="on_save_error must be 'raise' or 'warn'"):
        _io(save_options={"on_save_error": "ignore"})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['verfiy'\]"):
        _io(load_options={"verfiy": False})
    io = _io(save_options={"timeout": 60.0}, load_options={"verify": False})
    assert io.save_options == {"timeout": 60.0} and io.load_options == {"verify": False}


def test_a_removal_waits_for_the_async_save_of_its_tag(tmp_path):
    """remove_checkpoint right after an async save: the save commits first, then the tag goes (never half of it)."""
    io = _io(async_save=True)
    state = {"state_dict": {f"w{i}": torch.randn(256, 1024) for i in range(16)}, "epoch": 0}  # 16 MiB
    io.save_checkpoint(state, str(tmp_path / "a.ckpt"))
    io.remove_checkpoint(str(tmp_path / "a.ckpt"))
    io.save_checkpoint(state, str(tmp_path / "b.ckpt"))
    io.teardown()
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["b.ckpt"]
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "b.ckpt"]


def test_a_tag_removed_and_saved_again_is_complete(tmp_path):
    io = _io(async_save=True)
    path = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "epoch": 0}, path)
    io.remove_checkpoint(path)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 1}, path)
    io.teardown()
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(4))


def test_a_tag_that_took_a_newer_versioned_name_is_not_removed(tmp_path):
    """Lightning saves x-v1.ckpt (tag x.ckpt again), then removes the older x.ckpt: the tag holds x-v1's state."""
    io = _io()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1)}}, str(tmp_path / "x.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, str(tmp_path / "x-v1.ckpt"))
    io.remove_checkpoint(str(tmp_path / "x.ckpt"))
    assert nxd.list_checkpoint_tags(str(tmp_path)) == ["x.ckpt"]
    io.remove_checkpoint(str(tmp_path / "x-v1.ckpt"))
    assert nxd.list_checkpoint_tags(str(tmp_path)) == []


def test_removing_a_linked_last_removes_the_link_only(tmp_path):
    """ModelCheckpoint(save_last="link") makes last.ckpt a symbolic link to a tag: removing it never follows it."""
    io = _io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, str(tmp_path / "step=2.ckpt"))
    os.symlink("step=2.ckpt", tmp_path / "last.ckpt")
    assert io.load_checkpoint(str(tmp_path / "last.ckpt"))["state_dict"]["w"].item() == 1.0
    io.remove_checkpoint(str(tmp_path / "last.ckpt"))
    nxd.list_checkpoint_tags(str(tmp_path))  # waits for the queued removal
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "step=2.ckpt"]
    assert (tmp_path / "step=2.ckpt" / "done").exists()


def test_without_lightning_the_error_says_what_to_install(monkeypatch):
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'pytorch-lightning>=2.1,<3'"):
        lightning_package()


def test_omegaconf_hyper_parameters_become_plain_containers():
    """NxDT's config is an OmegaConf DictConfig: stored as plain dicts (loads without unpickling), ZeRO-1 read."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"cfg": {"wrap_with_zero": True, "layers": [1, 2]}})
    _, _, content = split_checkpoint({"state_dict": {}, "hyper_parameters": cfg})
    assert content["hyper_parameters"] == {"cfg": {"wrap_with_zero": True, "layers": [1, 2]}}
    assert type(content["hyper_parameters"]) is dict and type(content["hyper_parameters"]["cfg"]["layers"]) is list
    assert zero1_from_config(content)


def test_a_link_to_an_interrupted_save_loads_the_newest_complete_tag(tmp_path, caplog):
    """save_last="link" links last.ckpt before an async save is complete: after a crash, "last" is the newest
    complete checkpoint."""
    io = _io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}, "global_step": 2}, str(tmp_path / "step=2.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1)}, "global_step": 4}, str(tmp_path / "step=4.ckpt"))
    (tmp_path / "step=4.ckpt" / "done").unlink()  # as if the job died while step 4 was being written
    os.symlink("step=4.ckpt", tmp_path / "last.ckpt")
    loaded = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert loaded["global_step"] == 2 and loaded["state_dict"]["w"].item() == 1.0
    assert "not complete" in caplog.text and "step=2.ckpt" in caplog.text
    with pytest.raises(nxd.CheckpointError, match="step=4.ckpt"):
        io.load_checkpoint(str(tmp_path / "step=4.ckpt"))  # named directly: refused, not replaced


def test_the_lightning_package_works_too(tmp_path):
    """The same classes built on ``lightning.pytorch`` (the unified ``lightning`` package) save and load."""
    lp = pytest.importorskip("lightning.pytorch")
    classes = classes_for("lightning.pytorch")
    assert issubclass(classes["NxdDDPStrategy"], lp.strategies.DDPStrategy)
    assert issubclass(classes["NxdXLAStrategy"], lp.strategies.XLAStrategy)

    class Module(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)

    io = classes["NxdCheckpointIO"]()
    trainer = lp.Trainer(
        accelerator="cpu", max_steps=2, plugins=[io], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module())
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"))
    loaded = io.load_checkpoint(str(tmp_path / "a.ckpt"))
    assert loaded["global_step"] == 2 and set(loaded["state_dict"]) == {"net.weight", "net.bias"}


def test_the_imported_lightning_package_is_the_one_built_on():
    """A program that imported lightning.pytorch gets classes of that package (a fresh interpreter)."""
    pytest.importorskip("lightning.pytorch")
    code = (
        "import lightning.pytorch as L\n"
        "from nxd_ckpt.lightning import NxdCheckpointIO, NxdDDPStrategy\n"
        "assert issubclass(NxdCheckpointIO, L.plugins.io.CheckpointIO)\n"
        "assert issubclass(NxdDDPStrategy, L.strategies.DDPStrategy)\n"
        "import sys; assert 'pytorch_lightning.plugins.io' not in sys.modules or not issubclass(\n"
        "    NxdCheckpointIO, sys.modules['pytorch_lightning'].plugins.io.CheckpointIO)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=240)


def test_removals_go_through_the_managers_injected_storage(tmp_path, monkeypatch):
    """A manager built with its own storage (``CheckpointManager(storage=...)``) deletes Lightning's checkpoints
    through that storage too, not through one of its own for the same directory."""
    from nxd_ckpt import api
    from nxd_ckpt.manager import CheckpointManager
    from nxd_ckpt.storage import LocalStorage
    from nxd_ckpt.testing.counting import RequestCountingStorage

    storage = RequestCountingStorage(LocalStorage(str(tmp_path)))
    monkeypatch.setattr(api._default, "manager", CheckpointManager(storage=lambda _directory: storage))
    io = _io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, str(tmp_path / "a.ckpt"))
    deletes = storage.by_prefix["a.ckpt"].get("DELETE", 0)  # the save's own (stale files it replaces)
    io.remove_checkpoint(str(tmp_path / "a.ckpt"))
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json"]
    assert storage.by_prefix["a.ckpt"]["DELETE"] == deletes + 1  # 'done', through the injected storage


def test_loads_go_through_the_managers_injected_storage(tmp_path, monkeypatch):
    """Loading reads the tag (its link, its description, its files) through the manager's injected storage only."""
    from nxd_ckpt import api
    from nxd_ckpt.manager import CheckpointManager
    from nxd_ckpt.storage import LocalStorage, local
    from nxd_ckpt.testing.counting import RequestCountingStorage

    storage = RequestCountingStorage(LocalStorage(str(tmp_path)))
    monkeypatch.setattr(api._default, "manager", CheckpointManager(storage=lambda _directory: storage))
    io = _io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, str(tmp_path / "a.ckpt"))
    io.teardown()
    gets = sum(storage.by_prefix["a.ckpt"].values())

    def no_other_storage(*args, **kwargs):
        raise AssertionError("a LocalStorage made behind the manager's back")

    monkeypatch.setattr(local.LocalStorage, "__init__", no_other_storage)
    checkpoint = io.load_checkpoint(str(tmp_path / "a.ckpt"))
    assert torch.equal(checkpoint["state_dict"]["w"], torch.ones(1))
    assert sum(storage.by_prefix["a.ckpt"].values()) > gets
