"""Loads into tensors that already exist read each file once, straight into those tensors' memory: no fresh
copy of the state, the same parameter and optimizer-state memory before and after, bit-exact, verified."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import nxd_ckpt as nxd
from nxd_ckpt import adapters, statefile
from nxd_ckpt.errors import IntegrityError, StateMismatchError
from nxd_ckpt.format import layout
from nxd_ckpt.serialization import readinto, xser
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.storage import direct as direct_io
from nxd_ckpt.testing.counting import ReadCountingStorage
from nxd_ckpt.testing.fakes import assert_state_equal

_BOOKKEEPING = ("/nxd_ckpt/", f"/{layout.METADATA_FILE}")


class Wide(nn.Module):
    """Parameters of 1-4 MiB (large enough for the O_DIRECT and lined-up paths), a bf16 one and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 1024)
        self.b = nn.Linear(1024, 512, bias=False)
        self.emb = nn.Parameter(torch.zeros(300, 700, dtype=torch.bfloat16))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def _trained(seed: int) -> tuple[Wide, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Wide()
    with torch.no_grad():
        model.emb.normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 512)
    loss = model.b(model.a(x)).square().mean() + model.emb.float().square().mean()
    loss.backward()
    opt.step()
    model.count += seed
    return model, opt


def _pointers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    out = {f"model/{k}": v.data_ptr() for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out |= {f"optim/{i}/{k}": v.data_ptr() for k, v in per_param.items()}
    return out


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_load_into_live_module_and_optimizer_keeps_their_memory_bit_exact_one_read(
    tmp_path, monkeypatch, use_xser, verify
):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    ckpt = str(tmp_path / "ckpt")
    saved_model, saved_opt = _trained(seed=1)
    nxd.save_checkpoint(ckpt, "step_1", model=saved_model, optimizer=saved_opt, use_xser=use_xser)

    model, opt = _trained(seed=2)  # a live model and optimizer with other values
    before = _pointers(model, opt)
    storage = ReadCountingStorage(ckpt)
    nxd.load_checkpoint(storage, model=model, optimizer=opt, verify=verify)

    assert _pointers(model, opt) == before  # same memory: parameters and optimizer state were read into
    assert_state_equal(model.state_dict(), saved_model.state_dict())
    assert_state_equal(opt.state_dict(), saved_opt.state_dict())
    data_files = {p: n for p, n in storage.bytes_read.items() if not any(b in p for b in _BOOKKEEPING)}
    if use_xser and not verify:  # unverified, torch.load parses the small reference and info files with seeks
        data_files = {p: n for p, n in data_files.items() if ".tensors/" in p}
    assert data_files == {p: os.path.getsize(os.path.join(ckpt, p)) for p in data_files}  # each byte once
    assert any("/model/" in p for p in data_files) and any("/optim/" in p for p in data_files)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_state_file_read_lands_in_the_target_tensors(tmp_path, monkeypatch, use_xser):
    """The loaded state's tensors are the target's memory (so load_state_dict has nothing left to copy)."""
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    saved, _ = _trained(seed=3)
    storage = LocalStorage(tmp_path)
    statefile.write_state_file(storage, "m.pt", saved.state_dict(), xser_encoding=use_xser)
    live, _ = _trained(seed=4)
    target = adapters.load_target(live, "model", strict=True, source="m.pt")
    state = statefile.read_state_file(storage, "m.pt", target=target)
    params = dict(live.named_parameters()) | dict(live.named_buffers())
    for key, tensor in state.items():
        assert tensor.data_ptr() == params[key].data_ptr(), key
    expected = sum(t.numel() * t.element_size() for t in saved.state_dict().values())
    assert target.bytes_in_place == expected
    assert_state_equal(live.state_dict(), saved.state_dict())  # already there, before any load_state_dict


def test_dict_targets_with_tensors_are_read_into_and_fresh_dicts_get_fresh_memory(tmp_path):
    saved, _ = _trained(seed=5)
    nxd.save_checkpoint(str(tmp_path), "t", model=saved.state_dict(), use_xser=True)
    live = {k: torch.empty_like(v) for k, v in saved.state_dict().items()}
    pointers = {k: v.data_ptr() for k, v in live.items()}
    nxd.load_checkpoint(str(tmp_path), model=live)
    assert {k: v.data_ptr() for k, v in live.items()} == pointers
    assert_state_equal(live, saved.state_dict())
    fresh: dict = {}
    nxd.load_checkpoint(str(tmp_path), model=fresh)
    assert_state_equal(fresh, saved.state_dict())


def test_a_state_that_does_not_fit_fails_before_touching_the_model(tmp_path):
    saved, _ = _trained(seed=6)
    state = saved.state_dict()
    state["extra.weight"] = torch.ones(3)
    for use_xser in (False, True):
        nxd.save_checkpoint(str(tmp_path), f"t{int(use_xser)}", model=state, use_xser=use_xser)
        live, _ = _trained(seed=7)
        before = {k: v.clone() for k, v in live.state_dict().items()}
        with pytest.raises(StateMismatchError, match="extra.weight"):
            nxd.load_checkpoint(str(tmp_path), f"t{int(use_xser)}", model=live)
        assert_state_equal(live.state_dict(), before)  # nothing landed: checked on the saved structure first


def test_corrupt_tensor_file_is_named_when_reading_into_a_live_model(tmp_path, monkeypatch):
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    saved, _ = _trained(seed=8)
    nxd.save_checkpoint(str(tmp_path), "t", model=saved, use_xser=True)
    files = LocalStorage(tmp_path).walk_files("t")
    victim = max((p for p in files if ".tensors/" in p), key=lambda p: os.path.getsize(tmp_path / p))
    with open(tmp_path / victim, "r+b") as f:
        f.seek(os.path.getsize(tmp_path / victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    live, _ = _trained(seed=9)
    with pytest.raises(IntegrityError, match=f"{victim} is corrupt"):
        nxd.load_checkpoint(str(tmp_path), model=live)


def test_layouts_the_streaming_reader_does_not_handle_fall_back_within_the_same_single_read():
    legacy = io.BytesIO()
    state = {"w": torch.randn(64, 64)}
    torch.save(state, legacy, _use_new_zipfile_serialization=False)  # not a zip at all
    legacy.seek(0)
    with pytest.raises(readinto.Fallback) as raised:
        readinto.load_into(legacy, what="legacy", make_unpickler=xser.tensor_unpickler, choose=lambda m: {})
    assert raised.value.data == legacy.getvalue()  # every byte, read once, for the in-memory parser


def test_lined_up_tensor_files_are_read_with_o_direct_into_the_destination(direct_dir):
    """A file written from a tensor's memory lines up with memory allocated alike: the read goes around the
    page cache straight into the destination (the same tensor here: its address is the one the file lines up
    with)."""
    t = torch.randn(3 << 20 >> 2)  # 3 MiB
    expected = t.clone()
    storage = LocalStorage(direct_dir)
    statefile.write_state_file(storage, "x.pt", {"t": t}, xser_encoding=True)
    tensor_path = layout.xser_tensor_file("x.pt", 0)
    t.zero_()
    with storage.open_sequential(tensor_path, direct=True) as f:
        assert isinstance(f, direct_io.DirectReader)
        out = readinto.load_into(f, what="x", make_unpickler=xser.tensor_unpickler, choose=lambda m: {id(m): t})
        assert f.direct_bytes >= (3 << 20) - (16 << 10)  # all but a few blocks around the headers
    assert out.data_ptr() == t.data_ptr() and torch.equal(t, expected)
    assert os.path.getsize(direct_dir / tensor_path) > 3 << 20


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_fresh_dict_loads_stream_each_file_once_through_the_page_cache(tmp_path, monkeypatch, use_xser):
    """Loads into fresh dicts read each file once, front to back, through the page cache with reads queued
    ahead (O_DIRECT into fresh memory needs its pages faulted in first, which measured slower here), verified,
    and build what torch.load builds: each tensor its own storage."""
    torch.manual_seed(3)
    state = {"big": torch.randn(3 << 20 >> 2), "other": torch.randn(600, 1000), "small": torch.randn(10)}
    nxd.save_checkpoint(str(tmp_path), "t", model=state, use_xser=use_xser)
    storage = ReadCountingStorage(str(tmp_path))
    direct_streams: list[str] = []
    real_init = direct_io.DirectReader.__init__

    def recording_init(self: direct_io.DirectReader, path: str) -> None:
        direct_streams.append(path)
        real_init(self, path)

    monkeypatch.setattr(direct_io.DirectReader, "__init__", recording_init)
    loaded: dict = {}
    nxd.load_checkpoint(storage, "t", model=loaded, verify=True)
    assert_state_equal(state, loaded)
    assert not direct_streams
    state_files = {p: n for p, n in storage.bytes_read.items() if p.startswith("t/model/")}
    assert state_files
    for path, n in state_files.items():
        assert n == os.path.getsize(tmp_path / path), path  # each file read once, whole
    for name in ("big", "other"):
        assert loaded[name].untyped_storage().nbytes() == state[name].numel() * 4  # as torch.load's


@pytest.fixture
def direct_dir(tmp_path):
    flag = getattr(os, "O_DIRECT", 0)
    try:
        if not flag:
            raise OSError("no O_DIRECT")
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | flag))
    except OSError:
        pytest.skip("no O_DIRECT on this filesystem")
    os.unlink(tmp_path / "probe")
    return tmp_path


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    import nxd_ckpt as nxd

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    ckpt, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])  # 64 MiB of parameters, touched
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if mode == "save":
        nxd.save_checkpoint(ckpt, "t", model=model, use_xser=sys.argv[3] == "xser")
        sys.exit(0)
    nxd.load_checkpoint(ckpt, model={} if mode == "fresh" else model)  # warm up: imports, thread pools
    import gc; gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
    base = rss("VmRSS:")
    target = {} if mode == "fresh" else model
    nxd.load_checkpoint(ckpt, model=target)
    print(json.dumps({"extra": rss("VmHWM:") - base, "state": state_bytes}))
    """
)


def _peak(ckpt: str, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, ckpt, mode], capture_output=True, text=True, timeout=600, check=True
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_peak_extra_host_memory_of_a_live_load_is_a_few_buffers_not_a_copy(tmp_path, use_xser):
    """Measured as peak RSS in a fresh process (not timed): a load into the live model adds a few MiB at most;
    a load into a fresh dict (the same measure's control) adds the whole state."""
    ckpt = str(tmp_path / "ckpt")
    subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, ckpt, "save", "xser" if use_xser else "plain"], check=True, timeout=600
    )
    live = _peak(ckpt, "live")
    fresh = _peak(ckpt, "fresh")
    assert fresh["extra"] >= 0.9 * fresh["state"]  # the control: the measure sees a copy of the state
    assert live["extra"] <= 0.15 * live["state"], live  # 64 MiB state: under ~10 MiB of extra memory


def test_page_cache_reads_ask_the_kernel_to_read_ahead_of_the_reader(tmp_path, monkeypatch):
    """Sequential reads through the page cache keep a window of reads queued ahead (POSIX_FADV_WILLNEED), so a
    cold disk gets large requests while the reader copies and hashes 1 MiB pieces; the bytes are unchanged."""
    data = os.urandom(40 << 20)
    (tmp_path / "f").write_bytes(data)
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    out = bytearray(len(data))
    with LocalStorage(str(tmp_path)).open_sequential("f", direct=False) as f:
        view, done = memoryview(out), 0
        while done < len(data):
            n = f.readinto(view[done : done + (1 << 20)])
            assert advised and advised[-1][0] + advised[-1][1] >= min(len(data), done + (16 << 20))  # well ahead
            done += n
    assert bytes(out) == data
    covered = sorted(advised)
    assert covered[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(covered))  # contiguous
