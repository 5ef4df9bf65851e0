"""RNG capture/restore: every stream continues exactly, and the snapshot survives a weights_only round trip."""

from __future__ import annotations

import io
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from nxd_ckpt.rng import capture_rng_state, restore_rng_state
from nxd_ckpt.serialization import plain


def _draw() -> tuple:
    """One value from each host stream, including the ones dropout and shuffling use."""
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),  # leaves a cached Gaussian behind: part of the state too
        torch.rand(4).tolist(),
        torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(),
    )


def _weights_only_round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    plain.save(state, buf)
    buf.seek(0)
    return plain.load(buf, what="rng round trip")


def test_restore_continues_every_host_stream_exactly():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    state = _weights_only_round_trip(capture_rng_state())
    expected = [_draw() for _ in range(3)]
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(state)
    assert [_draw() for _ in range(3)] == expected


def test_capture_does_not_advance_any_stream():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    before = capture_rng_state()
    capture_rng_state()
    after = capture_rng_state()
    assert torch.equal(before["torch_cpu"], after["torch_cpu"])
    assert before["python"] == after["python"]
    assert before["numpy"] == after["numpy"]


def test_snapshot_holds_only_plain_values_and_cpu_tensors():
    state = capture_rng_state()
    assert isinstance(state["python"], tuple) and all(isinstance(v, int) for v in state["python"][1])
    assert isinstance(state["numpy"]["key"], list) and len(state["numpy"]["key"]) == 624
    assert state["torch_cpu"].dtype == torch.uint8 and state["torch_cpu"].device.type == "cpu"


def test_restore_rejects_something_else_naming_the_source():
    with pytest.raises(ValueError, match="ckpt/step_1.*not an nxd_ckpt RNG snapshot"):
        restore_rng_state({"seed": 1}, source="ckpt/step_1")


def test_no_device_stream_without_torch_xla_and_no_import_of_it():
    # In a fresh interpreter: the XLA lane's test process has imported torch_xla already.
    code = (
        "import sys\n"
        "from nxd_ckpt.rng import capture_rng_state\n"
        "state = capture_rng_state()\n"
        "assert state['xla'] is None, state['xla']\n"
        "assert 'torch_xla' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.xla
def test_xla_device_stream_continues_exactly(caplog):
    pytest.importorskip("torch_xla")
    import torch_xla

    device = torch_xla.device()
    x = torch.ones(64, device=device)
    torch.nn.functional.dropout(x, 0.5).cpu()
    state = _weights_only_round_trip(capture_rng_state())
    assert isinstance(state["xla"], int)
    expected = [torch.nn.functional.dropout(x, 0.5).cpu() for _ in range(3)]
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(12345)
    restore_rng_state(state)
    for want in expected:
        assert torch.equal(torch.nn.functional.dropout(x, 0.5).cpu(), want)


def _stateful_loader(generator: torch.Generator | None = None, num_workers: int = 0):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = [torch.tensor([float(i)]) for i in range(12)]
    return StatefulDataLoader(data, batch_size=2, shuffle=False, generator=generator, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_without_generator_resumes_the_global_stream_exactly(tmp_path, num_workers):
    """A DataLoader without generator= draws its workers' base seed from torch's global stream whenever it
    creates an iterator; after a resume that extra draw must not shift dropout. New epochs still draw."""
    pytest.importorskip("torchdata.stateful_dataloader")
    import nxd_ckpt as nxd

    def loader():
        return _stateful_loader(num_workers=num_workers)

    torch.manual_seed(3)
    run_a = loader()
    it = iter(run_a)
    seen = [next(it) for _ in range(2)]
    nxd.save_checkpoint(str(tmp_path), "step_2", rank_state=run_a, save_rng=True)
    reference = [(next(it), torch.rand(2)) for _ in range(4)] + [(list(iter(run_a)), torch.rand(2))]
    assert seen

    torch.manual_seed(77)
    resumed = loader()
    nxd.load_checkpoint(str(tmp_path), "step_2", rank_state=resumed)
    it = iter(resumed)
    got = [(next(it), torch.rand(2)) for _ in range(4)] + [(list(iter(resumed)), torch.rand(2))]
    for (want_batch, want_draw), (got_batch, got_draw) in zip(reference, got, strict=True):
        assert torch.equal(want_draw, got_draw)
        if isinstance(want_batch, list):  # the next epoch: a new iterator, drawing its seed as run A's did
            assert all(torch.equal(a, b) for a, b in zip(want_batch, got_batch, strict=True))
        else:
            assert torch.equal(want_batch, got_batch)


def test_only_loaders_drawing_from_the_global_stream_are_wrapped():
    from nxd_ckpt.rng import keep_streams_through_first_iterator

    pytest.importorskip("torchdata.stateful_dataloader")
    assert not keep_streams_through_first_iterator(_stateful_loader(torch.Generator().manual_seed(1)))
    assert not keep_streams_through_first_iterator(object())
    loader = _stateful_loader()
    assert keep_streams_through_first_iterator(loader) and keep_streams_through_first_iterator(loader)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(loader)
    assert torch.equal(torch.get_rng_state(), before)  # the first iterator's seed draw was undone
    iter(loader)
    assert not torch.equal(torch.get_rng_state(), before)  # later ones draw as usual
