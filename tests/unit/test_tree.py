"""The one container rule (nxd_ckpt.tree) that every walker of nested state follows."""

from __future__ import annotations

import collections
import io
from typing import NamedTuple

import torch

from nxd_ckpt import tree
from nxd_ckpt.load import zero1_io
from nxd_ckpt.serialization import xser


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class Tagged(dict):
    """A dict subclass, as user content sometimes holds."""


def _state() -> dict:
    return {
        "od": collections.OrderedDict(w=torch.ones(2)),
        "pair": Pair(torch.zeros(3), 7),
        "tagged": Tagged(x=torch.arange(4)),
        "shape": torch.Size([2, 3]),
        "list": [torch.full((1,), 5.0), "s", (1, torch.tensor(2))],
    }


def test_children_treats_size_and_tensors_as_leaves() -> None:
    assert tree.children(torch.Size([2, 3])) is None
    assert tree.children(torch.ones(1)) is None
    assert list(tree.children((4, 5))) == [(0, 4), (1, 5)]
    assert list(tree.children({"k": 1})) == [("k", 1)]


def test_leaves_paths_are_keys_and_indices_depth_first() -> None:
    paths = [path for path, _ in tree.leaves(_state())]
    assert paths == [("od", "w"), ("pair", 0), ("tagged", "x"), ("list", 0), ("list", 2, 1)]
    assert [p for p, _ in tree.iter_tensors(_state())][:2] == ["od/w", "pair/0"]


def test_map_tensors_keeps_container_types() -> None:
    out = tree.map_tensors(_state(), lambda t: t + 1)
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["pair"]) is Pair and out["pair"].b == 7 and torch.equal(out["pair"].a, torch.ones(3))
    assert type(out["tagged"]) is Tagged
    assert type(out["shape"]) is torch.Size
    assert type(out["list"][2]) is tuple and torch.equal(out["list"][2][1], torch.tensor(3))


def test_plain_rule_names_no_user_class() -> None:
    out = tree.map_leaves(_state(), lambda t: t, plain=True)
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["pair"]) is tuple
    assert type(out["tagged"]) is dict
    assert type(out["shape"]) is torch.Size


def test_xser_reference_data_follows_the_plain_rule_and_round_trips() -> None:
    state = _state()
    ref, tensors = xser.encode(state)
    buf = io.BytesIO()
    xser.save_ref(ref, buf)  # pickles without Pair or Tagged: the reference file names no user class
    assert b"Pair" not in buf.getvalue() and b"Tagged" not in buf.getvalue()
    assert xser.referenced_tids(ref) == list(range(len(tensors)))
    back = xser.decode(ref, dict(enumerate(tensors)), what="test")
    assert type(back["pair"]) is tuple and back["pair"][0] is state["pair"].a
    assert back["shape"] == torch.Size([2, 3])


def test_shared_tensor_is_one_tid() -> None:
    t = torch.ones(2)
    ref, tensors = xser.encode({"a": t, "b": [t]})
    assert len(tensors) == 1 and xser.referenced_tids(ref) == [0]


def test_zero1_small_state_copy_keeps_named_tuples() -> None:
    src = {"x": Pair(torch.ones(1), 1)}
    dst = {"x": Pair(torch.zeros(1), 1)}
    zero1_io._copy_small_tensors(src, dst, set())
    assert torch.equal(dst["x"].a, torch.ones(1))
