"""Several GPUs per node: a rank whose state is on GPU 1 must never open a context on GPU 0, from any of the
library's threads (the transfer thread, the writers, the readers of a load; a thread starts on device 0, pytorch#21081).
The fake accelerator's test (tests/unit/device/test_device_threads.py) records each call's current device; here the
driver's own answer counts: whether GPU 0 has a primary context. Each scenario runs in a spawned process (a fresh
CUDA runtime). Skipped below two GPUs."""

from __future__ import annotations

import pytest
import torch

from harness.multiprocess import run_with_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA devices (this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0})",
)


@run_with_ranks(1)
def test_saves_and_a_load_of_state_on_gpu_1_open_no_context_on_gpu_0(tmp_path):
    """As a launcher's rank on GPU 1: ``set_device(1)`` on the training thread, a pooled async save, one under a
    host memory budget, a load into the live tensors, then no primary context on GPU 0."""
    from harness import native_state

    assert not torch._C._cuda_hasPrimaryContext(0), "GPU 0 had a context before the test"
    torch.cuda.set_device(1)
    native_state.saves_and_loads_on(str(tmp_path), "cuda:1")
    torch.cuda.synchronize(1)
    assert not torch._C._cuda_hasPrimaryContext(0), "a thread of the library opened a context on GPU 0"
