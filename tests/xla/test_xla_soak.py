"""Fifty async saves of a small XLA state in one process: live XLA tensors, pinned memory, threads and open files
stay flat after the first ten (the fake accelerator's soak runs a thousand: tests/unit/device)."""

from __future__ import annotations

import pytest

from harness import soak

pytestmark = pytest.mark.xla
XLA_LANE_ONLY = "needs torch_xla (runs in the XLA lane: NXD_CKPT_LANES=xla scripts/run_tests.sh)"
torch_xla = pytest.importorskip("torch_xla", reason=XLA_LANE_ONLY)


def test_fifty_async_saves_hold_no_more_device_tensors_pinned_memory_threads_or_files(tmp_path):
    with soak.memory_dir(tmp_path) as path:
        measures = soak.saves_hold_nothing(path, "xla", saves=50, every=10)
    assert measures[0].device > 0
