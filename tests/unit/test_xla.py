"""nxd_ckpt without torch_xla: a clear error when an XLA device is asked for, no import when it is not needed.

"Absent" is real in the CPU lane; in the XLA lane the tests hide the installed torch_xla from the import system
(``sys.modules["torch_xla"] = None`` makes ``import torch_xla`` raise), which is how Python reports a missing
module, so the same code path runs in both lanes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt import xla
from nxd_ckpt.testing.fakes import make_training


@pytest.fixture
def no_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_xla", None)


def test_requesting_an_xla_device_without_torch_xla_is_a_clear_error(no_torch_xla, tmp_path):
    model, opt, _ = make_training(device="cpu")
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, optimizer=opt)
    with pytest.raises(nxd.DeviceUnavailableError) as info:
        nxd.load_checkpoint(str(tmp_path), model={}, device="xla")
    message = str(info.value)
    assert "device='xla'" in message and "torch_xla" in message and "torch-xla" in message
    assert isinstance(info.value, RuntimeError)  # also catchable as the generic runtime error
    with pytest.raises(nxd.DeviceUnavailableError, match="xla:0"):
        xla.resolve_device("xla:0")


def test_dict_targets_get_cpu_tensors_and_cpu_devices_are_accepted(no_torch_xla, tmp_path):
    model, opt, _ = make_training(device="cpu")
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, optimizer=opt)
    default, explicit = {}, {}
    nxd.load_checkpoint(str(tmp_path), model=default)
    nxd.load_checkpoint(str(tmp_path), model=explicit, device="cpu")
    for state in (default, explicit):
        assert set(state) == set(model.state_dict())
        assert {t.device.type for t in state.values()} == {"cpu"}
        assert torch.equal(state["fc1.weight"], model.fc1.weight.detach())
    with pytest.raises(ValueError, match="not a valid torch device"):
        nxd.load_checkpoint(str(tmp_path), model={}, device="no-such-device")


def test_cpu_save_and_load_never_import_torch_xla(tmp_path):
    """Even where torch_xla is installed (XLA lane), CPU-only use must not import it (slow, grabs devices)."""
    code = textwrap.dedent(
        f"""
        import sys
        import nxd_ckpt as nxd
        from nxd_ckpt.testing.fakes import make_training
        model, opt, sched = make_training(device="cpu")
        nxd.save_checkpoint({str(tmp_path)!r}, "t", model=model, optimizer=opt, scheduler=sched)
        nxd.load_checkpoint({str(tmp_path)!r}, model=model, optimizer=opt, scheduler=sched)
        nxd.finalize_checkpoint()
        assert "torch_xla" not in sys.modules, "nxd_ckpt imported torch_xla for CPU state"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_transfer_batches_respect_the_byte_budget():
    sizes = [100, 50, 60, 300, 10, 10]
    batches = xla.plan_batches(sizes, budget=128)
    assert batches == [[0], [1, 2], [3], [4, 5]]  # order kept; an item over budget travels alone
    assert [i for b in batches for i in b] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 128 for b in batches if len(b) > 1)
    assert xla.plan_batches([], budget=1) == []
    with pytest.raises(ValueError, match="budget"):
        xla.plan_batches([1], budget=0)


def test_transfer_batches_can_start_small_and_double_up_to_the_budget():
    sizes = [10] * 16
    batches = xla.plan_batches(sizes, budget=80, first=20)
    assert [sum(sizes[i] for i in b) for b in batches] == [20, 40, 80, 20]  # 20, then x2 up to the budget
    assert [i for b in batches for i in b] == list(range(len(sizes)))
    assert xla.plan_batches([100, 10], budget=80, first=20) == [[0], [1]]  # a big first item still travels alone
    assert xla.plan_batches(sizes, budget=80, first=500) == xla.plan_batches(sizes, budget=80)
    with pytest.raises(ValueError, match="first transfer batch"):
        xla.plan_batches([1], budget=8, first=0)


def test_transfer_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(xla.BATCH_BYTES_ENV, raising=False)
    assert xla.batch_bytes_from_env() == xla.DEFAULT_BATCH_BYTES
    monkeypatch.setenv(xla.BATCH_BYTES_ENV, "4096")
    assert xla.batch_bytes_from_env() == 4096
    monkeypatch.setenv(xla.BATCH_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=xla.BATCH_BYTES_ENV):
        xla.batch_bytes_from_env()
