"""Checkpoints to s3:// on the loopback moto server: the same round trips as on local disk (plain and xser),
latest and retention, async saves, a save that completes through 503 SlowDown throttling, and a 2-rank ZeRO-1
save/load with retention and an async save."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import nxd_ckpt as nxd
from harness.multiprocess import run_with_ranks
from harness.s3server import ThrottlingProxy
from nxd_ckpt.storage.s3 import ENDPOINT_ENV, S3Storage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training, train_steps

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("xser_file_per_tensor")]  # tests count tensor files

MODEL_FILE = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
OPTIM_FILE = "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _trained(seed: int = 1):
    model, opt, sched = make_training(seed=seed)
    train_steps(model, opt, sched, 2, seed=seed)
    return model, opt, sched


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_round_trip(s3_url, use_xser):
    model, opt, sched = _trained()
    nxd.save_checkpoint(
        s3_url, "step_2", model=model, optimizer=opt, scheduler=sched, user_content={"step": 2}, use_xser=use_xser
    )
    files = S3Storage(s3_url).walk_files("step_2")
    assert {f"step_2/{n}" for n in ("checkpoint", "done", MODEL_FILE, OPTIM_FILE, "scheduler.pt")} <= set(files)
    tensor_files = [f for f in files if f.startswith(f"step_2/{MODEL_FILE}.tensors/tensor_")]
    assert len(tensor_files) == (len(model.state_dict()) if use_xser else 0)

    m2, o2, s2 = make_training(seed=7)
    assert nxd.load_checkpoint(s3_url, model=m2, optimizer=o2, scheduler=s2) == {"step": 2}
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert_state_equal(opt.state_dict(), o2.state_dict())
    assert s2.state_dict() == sched.state_dict()
    assert train_steps(model, opt, sched, 2, seed=3) == train_steps(m2, o2, s2, 2, seed=3)


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
def test_latest_and_retention(s3_url):
    model, _, _ = _trained()
    storage = S3Storage(s3_url)
    storage.write_bytes("step_0/checkpoint", b"1")  # an interrupted save, older than everything kept
    time.sleep(1.0)  # S3 stamps whole seconds: retention deletes a leftover only once it is surely older
    for step in range(1, 5):
        with torch.no_grad():
            model.fc1.bias.fill_(step)
        nxd.save_checkpoint(s3_url, f"step_{step}", model=model, user_content=step, num_kept_ckpts=2)
    storage.write_bytes("step_5/checkpoint", b"1")  # an interrupted save newer than the latest complete one
    assert nxd.list_checkpoint_tags(s3_url) == ["step_3", "step_4"]
    assert nxd.latest_checkpoint_tag(s3_url) == "step_4" and nxd.has_checkpoint(s3_url)
    assert storage.list_dir() == [".nxd-tags.json", "step_3", "step_4", "step_5"]  # + the index of latest
    restored = make_training(seed=9)[0]
    assert nxd.load_checkpoint(s3_url, model=restored) == 4
    assert torch.all(restored.fc1.bias == 4)
    with pytest.raises(nxd.CheckpointNotFoundError, match="step_5.*incomplete"):
        nxd.load_checkpoint(s3_url, "step_5", model=restored)


def test_async_save(s3_url):
    model, opt, _ = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    report = nxd.save_checkpoint(s3_url, "step_2", model=model, optimizer=opt, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)  # training goes on while the upload runs
    nxd.finalize_checkpoint()
    assert report.completed and report.bytes_written > 0
    restored = make_training(seed=9)[0]
    nxd.load_checkpoint(s3_url, model=restored)
    assert_state_equal(expected, restored.state_dict())


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
def test_save_completes_through_slowdown_throttling(s3_url, s3_server, monkeypatch):
    model, opt, sched = _trained()
    with ThrottlingProxy(s3_server.port, throttle_first=5) as proxy:
        monkeypatch.setenv(ENDPOINT_ENV, proxy.endpoint_url)  # takes precedence over AWS_ENDPOINT_URL_S3
        nxd.save_checkpoint(s3_url, "step_2", model=model, optimizer=opt, scheduler=sched, num_kept_ckpts=1)
        assert proxy.throttled == 5 and proxy.requests > 5
        m2, o2, _ = make_training(seed=7)
        nxd.load_checkpoint(s3_url, model=m2, optimizer=o2)
        assert nxd.list_checkpoint_tags(s3_url) == ["step_2"]
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert_state_equal(opt.state_dict(), o2.state_dict())


@run_with_ranks(2)
def test_two_rank_zero1_save_load_with_retention_and_async(s3_url):
    rank = dist.get_rank()
    nxd.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)  # DP = 2
    model, opt, sched = make_training(seed=0)
    train_steps(model, opt, sched, 1, seed=0)
    expected = {}
    for step in (1, 2):
        with torch.no_grad():  # model replicas stay identical; each rank's optimizer state differs (shards)
            model.fc1.bias.fill_(step)
            for state in opt.state.values():
                state["exp_avg"].add_(rank + step)
        expected[step] = ({k: v.clone() for k, v in model.state_dict().items()}, _clone(opt.state_dict()))
        nxd.save_checkpoint(
            s3_url,
            f"step_{step}",
            model=model,
            optimizer=opt,
            zero1_optimizer=True,
            num_kept_ckpts=1,
            async_save=step == 2,
        )
    nxd.finalize_checkpoint()
    dist.barrier()
    storage = S3Storage(s3_url)
    assert storage.list_dir() == [".nxd-tags.json", "step_2"]  # retention (rank 0 only) removed step_1
    optim_files = storage.list_dir("step_2/optim")
    assert optim_files == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    m2, o2, _ = make_training(seed=5)
    nxd.load_checkpoint(s3_url, model=m2, optimizer=o2)  # latest, resolved on rank 0 and broadcast
    assert_state_equal(expected[2][0], m2.state_dict())
    assert_state_equal(expected[2][1], o2.state_dict())


def _clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_a_denied_upload_fails_the_save_and_keeps_the_previous_checkpoint(
    s3_url, s3_server, monkeypatch, use_xser, async_save
):
    """Fault injection on S3: the optimizer file's upload is refused (403) in the middle of a save. The save
    fails with an error naming the file (from finalize for async saves), no 'done' appears, the previous tag
    stays the latest and loads, and retention deleted nothing."""
    model, opt, _ = _trained()
    nxd.save_checkpoint(s3_url, "step_1", model=model, optimizer=opt, use_xser=use_xser)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with ThrottlingProxy(s3_server.port, throttle_first=0, deny_writes_to="step_2/optim") as proxy:
        monkeypatch.setenv(ENDPOINT_ENV, proxy.endpoint_url)
        with pytest.raises(nxd.CheckpointError, match="optim") as failure:
            report = nxd.save_checkpoint(
                s3_url, "step_2", model=model, optimizer=opt, use_xser=use_xser, async_save=async_save, num_kept_ckpts=1
            )
            nxd.finalize_checkpoint()
            assert not async_save, f"the save was reported as {report}"
        assert proxy.denied >= 1
        assert "AccessDenied" in str(failure.value) or "denied" in str(failure.value).lower(), str(failure.value)
    monkeypatch.delenv(ENDPOINT_ENV)
    storage = S3Storage(s3_url)
    assert not storage.exists("step_2/done")
    assert nxd.list_checkpoint_tags(s3_url) == ["step_1"]  # retention never ran: step_1 is still there
    restored = make_training(seed=9)[0]
    nxd.load_checkpoint(s3_url, model=restored)
    assert_state_equal(expected, restored.state_dict())


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
def test_resave_of_a_complete_tag_on_s3(s3_url):
    """No directory rename on S3: the re-save is written beside the tag, then copied over it ('done' last)."""
    from harness.crashloop import model_state, optimizer_state
    from nxd_ckpt.format import layout
    from nxd_ckpt.storage import storage_for

    for version in (1, 2):
        nxd.save_checkpoint(
            s3_url, "step_1", model=model_state(version), optimizer=optimizer_state(version), user_content=version
        )
        model: dict = {}
        assert nxd.load_checkpoint(s3_url, model=model) == version
        assert_state_equal(model, model_state(version))
        assert nxd.verify(s3_url, "step_1").ok
    storage = storage_for(s3_url)
    assert not any(name.startswith((layout.RESAVE_PREFIX, layout.REPLACED_PREFIX)) for name in storage.list_dir(""))
    assert nxd.list_checkpoint_tags(s3_url) == ["step_1"]


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
def test_save_completes_through_a_slowdown_storm(s3_url, s3_server, monkeypatch):
    """A third of all requests answered 503 SlowDown, all through the save and the load: back-off absorbs it."""
    model, opt, sched = _trained()
    with ThrottlingProxy(s3_server.port, throttle_first=0, slowdown_rate=0.33, seed=26) as proxy:
        monkeypatch.setenv(ENDPOINT_ENV, proxy.endpoint_url)
        report = nxd.save_checkpoint(s3_url, "step_2", model=model, optimizer=opt, scheduler=sched, use_xser=True)
        assert report.completed
        m2, o2, _ = make_training(seed=7)
        nxd.load_checkpoint(s3_url, model=m2, optimizer=o2)
        assert proxy.throttled >= 10 and proxy.throttled > proxy.requests // 5, (proxy.throttled, proxy.requests)
    assert_state_equal(model.state_dict(), m2.state_dict())
    assert_state_equal(opt.state_dict(), o2.state_dict())


@pytest.mark.device_independent  # storage behaviour: runs once, in the CPU lane
def test_requests_of_one_save_are_counted(s3_url, s3_server, monkeypatch):
    """One PUT per object of the tag (no object written twice, no multipart for small files) and one for the
    root's tag index, and a handful of other requests for the whole save, counted at the wire."""
    model, opt, sched = _trained()
    nxd.save_checkpoint(s3_url, "step_1", model=model, optimizer=opt, scheduler=sched, use_xser=True)
    with ThrottlingProxy(s3_server.port, throttle_first=0) as proxy:
        monkeypatch.setenv(ENDPOINT_ENV, proxy.endpoint_url)
        nxd.save_checkpoint(s3_url, "step_2", model=model, optimizer=opt, scheduler=sched, use_xser=True)
        nxd.finalize_checkpoint()
        counts = dict(proxy.by_method)
    objects = S3Storage(s3_url, endpoint_url=s3_server.endpoint_url).walk_files("step_2")
    deleted = counts.get("DELETE", 0)
    assert counts.get("PUT") == len(objects) + 1 + deleted and deleted <= 1, (counts, len(objects))
    others = sum(n for kind, n in counts.items() if kind not in ("PUT", "DELETE"))
    assert others <= 8, counts  # measured: 3 LIST, 1 HEAD; and the index: 1 LIST, 1 GET
    assert counts.get("POST", 0) == 0, counts  # no multipart upload for files below the part size
