"""A flipped byte and a truncated file, in every kind of file a checkpoint has: load and verify() both detect it
and name the file."""

from __future__ import annotations

import os
import shutil

import pytest

import nxd_ckpt as nxd
from nxd_ckpt.errors import FormatError
from nxd_ckpt.testing.fakes import make_training, train_steps

pytestmark = pytest.mark.usefixtures("xser_file_per_tensor")  # these tests look at individual tensor files

STATE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"
COMMON = [
    f"model/{STATE}",
    f"optim/{STATE}",
    "scheduler.pt",
    "user_content.pt",
    "nxd_ckpt.json",
    "nxd_ckpt/manifest_rank_00000.json",
    "nxd_ckpt/rank_state_00000.pt",
]
XSER_ONLY = [
    f"model/{STATE}.info.pt",
    f"model/{STATE}.tensors/tensor_0.pt",
    f"optim/{STATE}.info.pt",
    f"optim/{STATE}.tensors/tensor_1.pt",
]


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x10]))


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    out = {}
    for use_xser in (False, True):
        ckpt = str(root / ("xser" if use_xser else "plain"))
        model, opt, sched = make_training(seed=3)
        train_steps(model, opt, sched, steps=2, seed=3)
        nxd.save_checkpoint(
            ckpt,
            "step_2",
            model=model,
            optimizer=opt,
            scheduler=sched,
            user_content={"step": 2},
            use_xser=use_xser,
            save_rng=True,
        )
        out[use_xser] = ckpt
    return out


CASES = [(False, rel) for rel in COMMON] + [(True, rel) for rel in COMMON + XSER_ONLY]


@pytest.mark.parametrize("damage", [flip_byte, truncate], ids=["flipped-byte", "truncated"])
@pytest.mark.parametrize(("use_xser", "rel"), CASES, ids=[f"{'xser' if x else 'plain'}:{r}" for x, r in CASES])
def test_damage_is_detected_and_named(tmp_path, pristine, use_xser, rel, damage):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(pristine[use_xser], ckpt)
    target = os.path.join(ckpt, "step_2", rel)
    assert os.path.isfile(target), f"the checkpoint has no {rel}"
    damage(target)

    report = nxd.verify(ckpt, "step_2")
    assert not report.ok
    assert any(f"step_2/{rel}" in p for p in report.problems), report.summary()

    model, opt, sched = make_training(seed=0)
    with pytest.raises(FormatError) as raised:  # IntegrityError is a FormatError
        nxd.load_checkpoint(ckpt, model=model, optimizer=opt, scheduler=sched)
    assert f"step_2/{rel}" in str(raised.value), str(raised.value)
