"""Per-rank state in a world of one: both object protocols, both storage patterns, and the errors users meet."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.resume_state import normalize


class Counter:
    """torch-style: state_dict()/load_state_dict()."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value, "history": torch.arange(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        assert torch.equal(state["history"], torch.arange(self.value))


class EnergonLike:
    """Megatron Energon-style: save_state_rank()/restore_state_rank(), plain values."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def save_state_rank(self) -> dict:
        return {"offset": self.offset}

    def restore_state_rank(self, state: dict) -> None:
        self.offset = state["offset"]


@dataclass
class LoaderPosition:
    sample: int


class EnergonWithDataclass(EnergonLike):
    """Energon's real states are dataclasses: loading them needs allow_pickle=True."""

    def save_state_rank(self) -> LoaderPosition:  # type: ignore[override]
        return LoaderPosition(self.offset)

    def restore_state_rank(self, state: LoaderPosition) -> None:  # type: ignore[override]
        self.offset = state.sample


@pytest.mark.parametrize("mode", ["per_rank", "gather"])
def test_dict_of_both_protocols_and_rng_round_trip(tmp_path, mode):
    ckpt = str(tmp_path)
    model = torch.nn.Linear(2, 2)
    random.seed(3)
    nxd.save_checkpoint(
        ckpt,
        "step_1",
        model=model,
        rank_state={"counter": Counter(5), "loader": EnergonLike(17)},
        save_rng=True,
        rank_state_mode=mode,
    )
    expected_next = random.random()
    extras = [n for n in os.listdir(tmp_path / "step_1" / "nxd_ckpt") if n.startswith("rank_state")]
    assert extras == ["rank_state_00000.pt" if mode == "per_rank" else "rank_states.pt"]

    counter, loader = Counter(), EnergonLike()
    random.seed(99)
    nxd.load_checkpoint(ckpt, "step_1", model=model, rank_state={"counter": counter, "loader": loader})
    assert (counter.value, loader.offset) == (5, 17)
    assert random.random() == expected_next


class Buffer:
    """A state_dict() that returns live references, as many loaders do."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.weights = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.weights = list(state["seen"]), state["weights"].clone()


@pytest.mark.parametrize("mode", ["per_rank", "gather"])
def test_async_save_snapshots_live_state_before_returning(tmp_path, mode):
    live = Buffer()
    live.seen += [1, 2]
    report = nxd.save_checkpoint(str(tmp_path), "t", rank_state=live, rank_state_mode=mode, async_save=True)
    live.seen.append(3)  # training goes on while the file is written
    live.weights += 1
    report.wait()
    nxd.finalize_checkpoint()
    restored = Buffer()
    nxd.load_checkpoint(str(tmp_path), "t", rank_state=restored)
    assert restored.seen == [1, 2] and torch.equal(restored.weights, torch.zeros(3))


def test_single_object_round_trip_and_rng_restored_without_asking(tmp_path):
    torch.manual_seed(0)
    nxd.save_checkpoint(str(tmp_path), "t", rank_state=Counter(3), save_rng=True)
    expected = torch.rand(3)
    torch.manual_seed(1)
    nxd.load_checkpoint(str(tmp_path), "t")  # no rank_state passed: the saved RNG streams are still restored
    assert torch.equal(torch.rand(3), expected)
    restored = Counter()
    nxd.load_checkpoint(str(tmp_path), "t", rank_state=restored)
    assert restored.value == 3


def test_skip_rank_state_leaves_objects_and_rng_alone(tmp_path):
    torch.manual_seed(0)
    nxd.save_checkpoint(str(tmp_path), "t", rank_state=Counter(3), save_rng=True)
    torch.manual_seed(1)
    expected = torch.get_rng_state()
    untouched = Counter(8)
    nxd.load_checkpoint(str(tmp_path), "t", rank_state=untouched, skip_rank_state=True)
    assert untouched.value == 8 and torch.equal(torch.get_rng_state(), expected)


def test_dataclass_states_need_allow_pickle(tmp_path):
    nxd.save_checkpoint(str(tmp_path), "t", rank_state=EnergonWithDataclass(4))
    with pytest.raises(nxd.UnsafeCheckpointError, match="allow_pickle=True"):
        nxd.load_checkpoint(str(tmp_path), "t", rank_state=EnergonWithDataclass())
    restored = EnergonWithDataclass()
    nxd.load_checkpoint(str(tmp_path), "t", rank_state=restored, allow_pickle=True)
    assert restored.offset == 4


def test_asking_for_rank_state_a_checkpoint_lacks_says_how_to_skip(tmp_path):
    nxd.save_checkpoint(str(tmp_path), "t", model=torch.nn.Linear(2, 2))
    with pytest.raises(nxd.FormatError, match="no per-rank state.*skip_rank_state=True"):
        nxd.load_checkpoint(str(tmp_path), "t", rank_state=Counter())


def test_missing_key_and_shape_mismatch_name_the_saved_keys(tmp_path):
    nxd.save_checkpoint(str(tmp_path), "t", rank_state={"counter": Counter(2)})
    with pytest.raises(KeyError, match=r"\['loader'\].*saved keys: \['counter'\]"):
        nxd.load_checkpoint(str(tmp_path), "t", rank_state={"counter": Counter(), "loader": EnergonLike()})
    with pytest.raises(KeyError, match="same shape"):
        nxd.load_checkpoint(str(tmp_path), "t", rank_state=Counter())


def test_bad_arguments_fail_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"rank_state\['n'\] is a int"):
        nxd.save_checkpoint(str(tmp_path), "t", rank_state={"n": 3})
    with pytest.raises(TypeError, match="rank_state is a list"):
        nxd.save_checkpoint(str(tmp_path), "t", rank_state=[Counter()])
    with pytest.raises(ValueError, match="rank_state_mode must be one of"):
        nxd.save_checkpoint(str(tmp_path), "t", rank_state=Counter(), rank_state_mode="global")
    assert not (tmp_path / "t").exists()


def test_normalize_shapes():
    counter = Counter()
    assert normalize(None) == ({}, False)
    assert normalize(counter) == ({"rank_state": counter}, True)
    assert normalize({"a": counter}) == ({"a": counter}, False)
