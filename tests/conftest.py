"""Shared fixtures: every test starts with a fresh nxd_ckpt manager and no model-parallel configuration."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import nxd_ckpt

HAVE_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None  # found without importing it
if HAVE_TORCH_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # this machine has no accelerator
if HAVE_TORCH_XLA and os.environ.get("NXD_CKPT_TEST_LANE") == "xla":
    # torch's autograd engine sizes its per-device queues once, at the first backward of the process: a CPU-only
    # test running backward before the XLA runtime has its device would break every later XLA backward
    # ("device_ready_queues_" internal assert). Training scripts create their XLA device first; so does the lane.
    import torch_xla

    torch_xla.device()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``xla``-marked tests when torch_xla is absent; in the XLA lane its absence is an error instead.
    ``device_independent`` suites (file protocol and storage fault injection, no state on a device) run once, in
    the CPU lane, which keeps both lanes together within CI's time budget."""
    if os.environ.get("NXD_CKPT_TEST_LANE") == "xla":
        once = pytest.mark.skip(reason="device-independent: runs once, in the CPU lane")
        for item in items:
            if item.get_closest_marker("device_independent") is not None:
                item.add_marker(once)
    if HAVE_TORCH_XLA:
        return
    if os.environ.get("NXD_CKPT_TEST_LANE") == "xla":
        raise pytest.UsageError("NXD_CKPT_TEST_LANE=xla but torch_xla is not installed: run scripts/setup_env.sh xla")
    skip = pytest.mark.skip(reason="needs torch_xla (runs in the XLA lane: NXD_CKPT_LANES=xla scripts/run_tests.sh)")
    for item in items:
        if item.get_closest_marker("xla") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_nxd_ckpt_state():
    nxd_ckpt.reset_manager()
    nxd_ckpt.destroy_model_parallel()
    yield
    nxd_ckpt.reset_manager()
    nxd_ckpt.destroy_model_parallel()
    _forget_compat()


def _forget_compat() -> None:
    """A test (or a doc example) that saved through ``nxd_ckpt.compat`` leaves NxD's names installed and
    ``g_iostate`` remembering its directory, as in a real process; the next test starts as a new process would."""
    compat = sys.modules.get("nxd_ckpt.compat")
    if compat is not None:
        compat.uninstall()
        compat.g_iostate.checkpoint_dir = None


@pytest.fixture(scope="module")
def xser_file_per_tensor():
    """Write every xser tensor to its own file (no inlining of small tensors), for test modules that inspect or
    damage tensor files of small test models (module-scoped, so module-scoped checkpoint fixtures see it too).
    Spawned ranks inherit it through the environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
        yield
