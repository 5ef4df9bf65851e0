"""Hostile pickles in checkpoint files never run by default; the error names the class and the opt-in.

Every payload creates a marker file when unpickled; the tests assert the marker does not appear (and, as a
control, that it does appear when the caller explicitly opts in with ``allow_pickle=True``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.errors import FormatError, IntegrityError, UnsafeCheckpointError
from nxd_ckpt.format import integrity
from nxd_ckpt.serialization import xser
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import assert_state_equal, make_training

pytestmark = pytest.mark.usefixtures("xser_file_per_tensor")  # these tests look at individual tensor files

STATE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def write_marker(path: str) -> None:
    Path(path).write_text("payload ran")


class SystemPayload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ExecPayload(SystemPayload):
    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('x')",))


class PopenPayload(SystemPayload):
    def __reduce__(self):
        return (subprocess.Popen, (["touch", self.marker],))


class FunctionPayload(SystemPayload):
    def __reduce__(self):
        return (write_marker, (self.marker,))


PAYLOADS = {
    "os.system": (SystemPayload, "posix.system"),
    "builtins.exec": (ExecPayload, "builtins.exec"),
    "subprocess.Popen": (PopenPayload, "subprocess.Popen"),
    "own function": (FunctionPayload, "write_marker"),
}
PLAIN_FILES = [f"model/{STATE}", f"optim/{STATE}", "scheduler.pt", "user_content.pt", "nxd_ckpt/rank_state_00000.pt"]
XSER_FILES = [f"model/{STATE}", f"model/{STATE}.info.pt", f"model/{STATE}.tensors/tensor_0.pt", "user_content.pt"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    out = {}
    for use_xser in (False, True):
        ckpt = str(root / ("xser" if use_xser else "plain"))
        model, opt, sched = make_training(seed=1)
        nxd.save_checkpoint(
            ckpt,
            "step_1",
            model=model,
            optimizer=opt,
            scheduler=sched,
            user_content={"a": 1},
            use_xser=use_xser,
            save_rng=True,
        )
        out[use_xser] = ckpt
    return out


def reseal(tag_dir: Path) -> None:
    """Recompute the manifests from the files as they are now: an attacker who can write files can do this too."""
    store = LocalStorage(tag_dir.parent)
    for path in integrity.manifest_paths(store, tag_dir.name):
        rank, records = integrity.parse_manifest(store.read_bytes(path), path)
        fresh = {
            rel: integrity.FileRecord(*integrity.hash_bytes((tag_dir / rel).read_bytes()), rank) for rel in records
        }
        store.write_bytes(path, integrity.manifest_bytes(tag_dir.name, rank, fresh))


def _plant(tmp_path: Path, source: str, rel: str, payload: object, seal: bool = True) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    target = ckpt / "step_1" / rel
    assert target.is_file(), rel
    hostile = {"state": payload} if "tensor_" not in rel else payload
    torch.save(hostile, target)
    if seal:
        reseal(ckpt / "step_1")
    return ckpt


CASES = [(False, rel) for rel in PLAIN_FILES] + [(True, rel) for rel in XSER_FILES]


@pytest.mark.parametrize("payload_name", list(PAYLOADS))
@pytest.mark.parametrize(("use_xser", "rel"), CASES, ids=[f"{'xser' if x else 'plain'}:{r}" for x, r in CASES])
def test_hostile_pickle_does_not_run(tmp_path, pristine, use_xser, rel, payload_name):
    cls, shown = PAYLOADS[payload_name]
    marker = tmp_path / "PWNED"
    ckpt = _plant(tmp_path, pristine[use_xser], rel, cls(str(marker)))
    model, opt, sched = make_training(seed=0)
    with pytest.raises(UnsafeCheckpointError) as raised:
        nxd.load_checkpoint(str(ckpt), model=model, optimizer=opt, scheduler=sched)
    message = str(raised.value)
    assert shown in message and "allow_pickle=True" in message and f"step_1/{rel}" in message, message
    report = nxd.verify(str(ckpt))  # verify reads the pickle's structure without executing it
    assert any(shown in n and "allow_pickle=True" in n for n in report.notes), report.summary()
    assert not marker.exists(), "the payload ran"


def test_tampering_without_resealing_fails_the_checksum_first(tmp_path, pristine):
    marker = tmp_path / "PWNED"
    ckpt = _plant(tmp_path, pristine[False], "user_content.pt", FunctionPayload(str(marker)), seal=False)
    with pytest.raises(IntegrityError, match="user_content.pt is corrupt"):
        nxd.load_checkpoint(str(ckpt), allow_pickle=True)  # even with the opt-in: the file is not what was saved
    assert not marker.exists()


def test_opt_in_runs_pickles_as_documented(tmp_path, pristine):
    """The control: the payload is live, and ``allow_pickle=True`` is the switch that lets it run."""
    marker = tmp_path / "PWNED"
    ckpt = _plant(tmp_path, pristine[False], "user_content.pt", FunctionPayload(str(marker)))
    nxd.load_checkpoint(str(ckpt), allow_pickle=True)
    assert marker.exists()


def _nxd_written(root: Path, user_content: object, use_xser: bool) -> tuple[str, dict]:
    """A tag as NeuronX Distributed writes it: plain torch.save files, no nxd_ckpt metadata or manifests."""
    tag = root / "ckpt" / "step_7"
    (tag / "model").mkdir(parents=True)
    state = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}
    model_path = tag / "model" / STATE
    if use_xser:  # references pickled under torch_xla's class name, one tensor file each
        refs = {k: xser.TensorReference(i) for i, k in enumerate(state)}
        with open(model_path, "wb") as f:
            xser.save_ref(refs, f)
        (tag / "model" / f"{STATE}.tensors").mkdir()
        for i, t in enumerate(state.values()):
            torch.save(t, tag / "model" / f"{STATE}.tensors" / f"tensor_{i}.pt")
    else:
        torch.save(state, model_path)
    torch.save(user_content, tag / "user_content.pt")
    (tag / "checkpoint").write_text("1")
    (tag / "done").write_text("1")
    return str(root / "ckpt"), state


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_nxd_written_checkpoints_load_with_the_opt_in_where_needed(tmp_path, use_xser):
    ckpt, state = _nxd_written(tmp_path, {"args": argparse.Namespace(lr=0.1), "step": 7}, use_xser)
    model: dict = {}
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace.*allow_pickle=True"):
        nxd.load_checkpoint(ckpt, model=model)
    content = nxd.load_checkpoint(ckpt, model=model, allow_pickle=True)
    assert content["args"].lr == 0.1 and content["step"] == 7
    assert_state_equal(model, state)


@pytest.mark.parametrize("use_xser", [False, True], ids=["plain", "xser"])
def test_nxd_written_format_types_need_no_opt_in(tmp_path, use_xser):
    """Tensors, containers, dtypes, sizes and xser's TensorReference are on the allow-list."""
    content = {"step": 7, "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "rng": torch.get_rng_state()}
    ckpt, state = _nxd_written(tmp_path, content, use_xser)
    model: dict = {}
    loaded = nxd.load_checkpoint(ckpt, model=model)
    assert_state_equal(model, state)
    assert loaded["dtype"] is torch.bfloat16 and loaded["shape"] == torch.Size([2, 3])


def test_truncated_hostile_file_is_a_format_error_not_code(tmp_path, pristine):
    marker = tmp_path / "PWNED"
    ckpt = _plant(tmp_path, pristine[False], "user_content.pt", SystemPayload(str(marker)))
    target = ckpt / "step_1" / "user_content.pt"
    os.truncate(target, target.stat().st_size // 2)
    reseal(ckpt / "step_1")
    with pytest.raises(FormatError):
        nxd.load_checkpoint(str(ckpt), allow_pickle=False)
    assert not marker.exists()
