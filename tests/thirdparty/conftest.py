"""Fixtures for running the pinned third-party code (harness.thirdparty) against nxd_ckpt."""

from __future__ import annotations

import atexit

import pytest
import torch.distributed as dist

import nxd_ckpt as nxd
from harness import thirdparty


@pytest.fixture(scope="module", autouse=True)
def _no_third_party_modules_afterwards():
    """Each test module's imports and stubs of third-party code are gone before the next module runs."""
    with thirdparty.isolated():
        yield


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


@pytest.fixture
def nxd_compat(nxd_real):
    """NxD's real checkpoint module with ``nxd_ckpt.compat.install()`` in force (undone afterwards)."""
    from nxd_ckpt import compat

    compat.install()
    try:
        yield nxd_real
    finally:
        compat.uninstall()
        compat.g_iostate.checkpoint_dir = None


@pytest.fixture
def nlp_checkpoint_io(nxd_compat):
    """NxDT 2.26's real ``NLPCheckpointIO`` class (stubs: NeMo, NxDT's utils package helpers; see
    harness.thirdparty)."""
    reason = thirdparty.missing(thirdparty.NXDT)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("lightning", reason="NxDT's nlp_overrides imports the lightning package (test extra)")
    pytest.importorskip("omegaconf", reason="NxDT's nlp_overrides imports omegaconf (test extra)")
    thirdparty.install_nemo_stubs()
    from neuronx_distributed_training.lightning_modules.nlp_overrides import NLPCheckpointIO

    return NLPCheckpointIO


@pytest.fixture
def optimum_real(nxd_compat):
    """optimum-neuron's pinned ``modeling_utils`` (``save_pretrained``), ``checkpointing`` (consolidation) and
    ``peft_model``, loaded from ../shared/thirdparty over the installed optimum-neuron package, which provides the
    modules that are not pinned (its model classes, ``TrainingNeuronConfig``, the transformation specs). Stubs: the
    Neuron SDK and NKI kernels only (harness.thirdparty)."""
    import importlib
    import importlib.util
    import os
    import sys

    reason = thirdparty.missing(thirdparty.OPTIMUM)
    if reason:
        pytest.skip(reason)
    thirdparty.install_nki_kernel_stub()
    pytest.importorskip(
        "optimum.neuron.models.training",
        reason="needs optimum-neuron's unpinned modules: pip install --no-deps optimum-neuron==0.4.2 with "
        "transformers~=4.57.1 optimum~=2.0.0 accelerate==1.8.1 peft==0.17.0 (pyproject extra 'frameworks')",
    )
    importlib.import_module("optimum.neuron.peft")  # the package first: its modules import each other
    saved = {}
    loaded = {}
    for rel in ("models/training/modeling_utils.py", "models/training/checkpointing.py", "peft/peft_model.py"):
        name = "optimum.neuron." + rel[:-3].replace("/", ".")
        file = os.path.join(thirdparty.path(thirdparty.OPTIMUM), "optimum", "neuron", rel)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        saved[name] = sys.modules.get(name)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded[rel.rsplit("/", 1)[1][:-3]] = module
    try:
        yield loaded
    finally:
        for name, module in saved.items():
            if module is not None:
                sys.modules[name] = module
