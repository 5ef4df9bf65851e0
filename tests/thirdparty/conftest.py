"""Fixtures for running the pinned third-party code (nxd_ckpt.testing.thirdparty) against nxd_ckpt."""

from __future__ import annotations

import atexit

import pytest
import torch.distributed as dist

import nxd_ckpt as nxd
from nxd_ckpt.testing import thirdparty


@pytest.fixture
def nxd_real(tmp_path):
    """NxD 2.29's real ``trainer.checkpoint`` module in a one-process gloo world with its ``parallel_state``
    initialised (TP=PP=1); torn down so the next test starts as a new process would."""
    reason = thirdparty.missing(thirdparty.NXD)
    if reason:
        pytest.skip(reason)
    checkpoint = thirdparty.import_nxd()
    from neuronx_distributed.parallel_layers import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    nxd.reset_manager()
    try:
        yield checkpoint
    finally:
        nxd.reset_manager()
        if checkpoint.g_iostate is not None:
            checkpoint.g_iostate.wait_all()
            checkpoint.g_iostate = None  # NxD's process-wide state; its exit hooks would outlive the group
        atexit.unregister(checkpoint.CheckpointIOState.wait_all)
        atexit.unregister(checkpoint.CheckpointIOState.finalize_shutdown)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
