"""A replicated optimizer's fingerprint: the same for equal state, different for another rank's shard; the check over
replica groups names both ranks and what to pass."""

from __future__ import annotations

import pytest
import torch

from nxd_ckpt.errors import StateMismatchError
from nxd_ckpt.save.replicated import OptimizerFingerprint, check_replicas, state_fingerprint


def _state(scale: float) -> dict:
    return {
        "state": {0: {"exp_avg": torch.arange(1000.0) * scale, "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }


def test_equal_state_gives_equal_fingerprints_and_other_values_other_ones():
    assert state_fingerprint(_state(1.0), 0) == state_fingerprint(_state(1.0), 0)
    assert state_fingerprint(_state(1.0), 0) != state_fingerprint(_state(2.0), 0)
    shifted = _state(1.0)
    shifted["state"][0]["exp_avg"] = shifted["state"][0]["exp_avg"].reshape(10, 100)
    assert state_fingerprint(shifted, 0) != state_fingerprint(_state(1.0), 0)  # the shape is part of it


def test_a_value_at_a_sampled_position_changes_it_and_empty_state_has_one():
    state = _state(1.0)
    before = state_fingerprint(state, 0)
    state["state"][0]["exp_avg"][-1] += 1  # the last element is always sampled
    assert state_fingerprint(state, 0) != before
    assert state_fingerprint({"state": {}, "param_groups": []}, 0) == state_fingerprint({"state": {}}, 1)


def test_replicas_that_differ_are_refused_naming_both_ranks_and_the_remedy():
    same = OptimizerFingerprint("a", "AcceleratedOptimizer(Custom)")
    other = OptimizerFingerprint("b", "AcceleratedOptimizer(Custom)")
    check_replicas([same, same, other, other], [[0, 1], [2, 3]])  # each group agrees with itself
    check_replicas([None, None, same, None], [[0, 1], [2, 3]])  # ZeRO-1 ranks send None
    with pytest.raises(StateMismatchError) as raised:
        check_replicas([same, other, same, same], [[0, 1], [2, 3]])
    message = str(raised.value)
    assert "ranks 0 and 1" in message and "AcceleratedOptimizer(Custom)" in message
    assert "zero1_optimizer=True" in message and "register_zero1_optimizer" in message
    assert "Nothing was written" in message


def test_a_state_in_zero1_layout_is_a_shard_of_its_rank_and_device_tensors_are_not_read():
    zero1 = {"base_state": {0: {"exp_avg": torch.zeros(4)}}, "shape_info": {0: (8,)}, "param_groups": []}
    assert state_fingerprint(zero1, 0) != state_fingerprint(zero1, 1)  # equal values, still each rank's own shard
    meta = {"state": {0: {"exp_avg": torch.empty(4, device="meta")}}}
    assert state_fingerprint(meta, 0) == state_fingerprint(meta, 1)  # off the host: shapes only, no device work
