"""The XLA rows (only where torch_xla imports): torch_xla's own ``xser.save``/``xser.load`` against nxd_ckpt's
xser saves of state on the XLA device, into fresh dicts and into the live module on the device."""

from __future__ import annotations

import os

from benchmarks.core.files import fsync_tree
from benchmarks.core.state import assert_same, have_torch_xla
from benchmarks.suites.saveload.bench import Bench, Timing, check_live, live, section, with_peak
from benchmarks.suites.saveload.nxd import fresh_dicts, live_load, on_xla


def _xser_save(b: Bench, directory: str) -> tuple[str, str]:
    """torch_xla's ``xser.save`` of the device state (model on rank 0, each rank's optimizer shard), fsynced;
    the two paths."""
    import torch_xla.utils.serialization as xser

    model, optimizer = on_xla(b)
    model_path, optim_path = os.path.join(directory, "model.pt"), os.path.join(directory, f"optim_{b.rank}.pt")
    os.makedirs(directory, exist_ok=True)
    if b.rank == 0:
        xser.save(model, model_path, master_only=False)
        fsync_tree(model_path + ".tensors")
    xser.save(optimizer, optim_path, master_only=False)
    fsync_tree(optim_path + ".tensors")
    fsync_tree(directory)
    return model_path, optim_path


@section("torch_xla_xser", "torch_xla xser.save (XLA tensors) +fsync / xser.load to CPU", have_torch_xla)
def torch_xla_xser(b: Bench) -> Timing:
    """torch_xla's xser save and load of the device state."""
    import torch_xla.utils.serialization as xser

    directory = b.path("txser")
    paths: list[str] = []
    save_s = b.timed(lambda: paths.extend(_xser_save(b, directory)))
    loaded: dict = {}

    def load() -> None:
        loaded["model"] = xser.load(paths[0])
        loaded["optim"] = xser.load(paths[1])

    timing = Timing(save_s, b.timed_load(load))
    if b.check:
        assert_same(b.model, loaded["model"], "torch_xla xser model")
    loaded.clear()
    b.clean("txser")
    return timing


@section("nxd_xser_from_xla", "nxd_ckpt use_xser=True from XLA tensors, load(verify=False) to CPU", have_torch_xla)
def nxd_xser_from_xla(b: Bench) -> Timing:
    """nxd_ckpt's xser save of the device state (device to host transfer included)."""
    return fresh_dicts(b, "nxd_xser_xla", use_xser=True, verify=False, device="xla")


@section("torch_xla_xser_live", "torch_xla xser.load + load_state_dict into the live module on the XLA device",
         have_torch_xla)  # fmt: skip
def torch_xla_xser_live(b: Bench) -> Timing:
    """torch_xla's resume: ``xser.load`` + ``load_state_dict`` into the live module on the device."""
    import torch_xla
    import torch_xla.utils.serialization as xser

    directory = b.path("txser_live")
    paths: list[str] = []
    save_s = b.timed(lambda: paths.extend(_xser_save(b, directory)))
    module = live(b, "xla")

    def load() -> None:
        module.load_state_dict(xser.load(paths[0]))
        xser.load(paths[1])
        torch_xla.sync()

    load_s, peak = b.timed_load_then_peak(load)
    timing = with_peak(b, Timing(save_s, load_s), peak)
    check_live(b, module, "torch_xla xser live model")
    torch_xla.sync()
    b.clean("txser_live")
    return timing


@section("nxd_xser_live_xla", "nxd_ckpt use_xser=True, verified load into the live module on the XLA device",
         have_torch_xla)  # fmt: skip
def nxd_xser_live_xla(b: Bench) -> Timing:
    """nxd_ckpt's resume onto the device: verified load into the live module there."""
    timing = live_load(b, "nxd_xser_live_xla", device="xla")
    import torch_xla

    torch_xla.sync()
    return timing
