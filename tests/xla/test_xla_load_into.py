"""Loads onto the XLA device: device targets take their data in place (same Parameter and optimizer-state
objects), through bounded host buffers and bulk host->device transfers, bit-exact."""

from __future__ import annotations

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import adapters, statefile
from nxd_ckpt.device.load_targets import LOAD_ARENA_BYTES, LOAD_ARENAS, DeviceLoadTarget
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: runs in the XLA lane")


def _model(seed: int, device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 256, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()
    return model, opt


@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
def test_load_onto_the_device_keeps_the_parameter_objects_and_is_bit_exact(tmp_path, monkeypatch, use_xser):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    device = torch_xla.device()
    saved, saved_opt = _model(1, device)
    nxd.save_checkpoint(str(tmp_path), "t", model=saved, optimizer=saved_opt, use_xser=use_xser)
    model, opt = _model(2, device)
    params = {k: id(v) for k, v in model.named_parameters()}
    states = {k: id(v) for k, v in opt.state[next(iter(model.parameters()))].items()}
    nxd.load_checkpoint(str(tmp_path), "t", model=model, optimizer=opt)
    assert {k: id(v) for k, v in model.named_parameters()} == params  # the same objects, new data
    if use_xser:  # plain files land in host memory and are placed in bulk after (optimizer state is adopted)
        assert {k: id(v) for k, v in opt.state[next(iter(model.parameters()))].items()} == states
    assert all(p.device.type == "xla" for p in model.parameters())
    cpu_state = {k: v.cpu() for k, v in model.state_dict().items()}
    assert_state_equal(cpu_state, {k: v.cpu() for k, v in saved.state_dict().items()})
    assert_state_equal(opt.state_dict(), saved_opt.state_dict())
    model(torch.ones(2, 256, device=device)).sum().backward()  # training goes on with the loaded state
    opt.step()
    torch_xla.sync()


def test_a_load_into_a_live_model_on_the_device_streams_through_the_documented_arenas(monkeypatch):
    """What a load builds for a live model on the device: ``LOAD_ARENAS`` host buffers of ``LOAD_ARENA_BYTES`` (the
    sizes measured best), not the class's bare defaults."""
    monkeypatch.delenv("NXD_CKPT_XLA_TRANSFER_BATCH_BYTES", raising=False)
    model, opt = _model(1, torch_xla.device())
    for obj, role in ((model, "model"), (opt, "optimizer")):
        target = adapters.load_target(obj, role)
        assert isinstance(target, DeviceLoadTarget), role
        assert (target.max_arenas, target.arena_bytes) == (LOAD_ARENAS, LOAD_ARENA_BYTES), role


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_xser", [True, False], ids=["xser", "plain"])
def test_device_loads_use_few_bulk_transfers_and_bounded_host_buffers(tmp_path, monkeypatch, use_xser):
    """Eight 1 MiB tensors through 2 MiB arenas: 4 transfers, never more than 2 arenas (4 MiB) of host memory.
    xser: four readers, one tensor file each. plain: one ``torch.save`` file streamed whole, each tensor's slice
    carved as its record is reached (carving them all when ``data.pkl`` was read waited forever for a third
    arena: every plain load of more than two arenas into a live XLA model, NxD's default format, hung)."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    device = torch_xla.device()
    state = {f"w{i}": torch.full((512, 512), float(i)) for i in range(8)}
    storage = LocalStorage(tmp_path)
    statefile.write_state_file(storage, "m.pt", state, xser_encoding=use_xser)
    live = {k: torch.zeros(512, 512).to(device) for k in state}
    torch_xla.sync()
    objects = {k: id(v) for k, v in live.items()}
    target = DeviceLoadTarget(live, arena_bytes=2 << 20, arenas=2)
    loaded = target.finish(statefile.read_state_file(storage, "m.pt", target=target, threads=4))
    assert {k: id(v) for k, v in loaded.items()} == objects  # the live tensors, not slices of reused arenas
    assert_state_equal({k: v.cpu() for k, v in live.items()}, state)
    assert target.transfers == 4 and target.bytes_to_device == 8 << 20
    assert target.host_bytes_allocated <= 4 << 20


@pytest.mark.timeout(180)
def test_a_plain_checkpoint_larger_than_the_arenas_loads_into_the_live_model(tmp_path, monkeypatch):
    """End to end, NxD's default format: a 0.5 MiB model and 1 MiB of AdamW state through 64 KiB arenas,
    bit-exact, and training goes on from it."""
    monkeypatch.setenv("NXD_CKPT_XLA_TRANSFER_BATCH_BYTES", str(64 << 10))
    device = torch_xla.device()
    saved, saved_opt = _model(1, device)
    nxd.save_checkpoint(str(tmp_path), "t", model=saved, optimizer=saved_opt, use_xser=False)
    model, opt = _model(2, device)
    params = {k: id(v) for k, v in model.named_parameters()}
    nxd.load_checkpoint(str(tmp_path), "t", model=model, optimizer=opt)
    assert {k: id(v) for k, v in model.named_parameters()} == params
    assert_state_equal(
        {k: v.cpu() for k, v in model.state_dict().items()}, {k: v.cpu() for k, v in saved.state_dict().items()}
    )
    assert_state_equal(opt.state_dict(), saved_opt.state_dict())
    model(torch.ones(2, 256, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()


@pytest.mark.timeout(120)
def test_a_damaged_tensor_file_fails_the_load_instead_of_stalling_the_other_readers(tmp_path):
    """A reader whose tensor file is damaged leaves its arena slice unfilled: the slice is dropped, so the arena
    still travels and the other readers, waiting for a free arena, go on; the load raises the damage (it used to
    wait forever: the arena never completed)."""
    from nxd_ckpt.format import layout

    state = {f"w{i}": torch.full((512, 512), float(i)) for i in range(8)}
    storage = LocalStorage(tmp_path)
    statefile.write_state_file(storage, "m.pt", state, xser_encoding=True)
    damaged = tmp_path / layout.xser_tensor_file("m.pt", 1)
    damaged.write_bytes(damaged.read_bytes()[: 600 << 10])  # cut inside the tensor's data
    live = {k: torch.zeros(512, 512).to(torch_xla.device()) for k in state}
    torch_xla.sync()
    target = DeviceLoadTarget(live, arena_bytes=2 << 20, arenas=2)
    with pytest.raises(nxd.FormatError, match="truncated"):
        statefile.read_state_file(storage, "m.pt", target=target, threads=4)


def test_dict_target_with_device_tensors_is_a_device_target():
    live = {"w": torch.zeros(4).to(torch_xla.device())}
    assert isinstance(adapters.load_target(live, "model"), DeviceLoadTarget)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_a_load_lands_in_parameters_updated_in_place_through_an_alias(tmp_path, use_xser):
    """``p.detach().zero_()`` (or ``dcp.load`` into ``model.state_dict()``) leaves an update pending on each
    parameter; the streamed load must win over it (it used to be regenerated from the alias at the next use, so
    the weights kept their zeros while the inline biases loaded)."""
    torch_xla = pytest.importorskip("torch_xla")
    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64)).to(device)
    torch_xla.sync()
    nxd.save_checkpoint(str(tmp_path), "step_0", model=model, use_xser=use_xser)
    expected = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.detach().zero_()
    nxd.load_checkpoint(str(tmp_path), "step_0", model=model)
    assert_state_equal({k: v.cpu() for k, v in model.state_dict().items()}, expected)
