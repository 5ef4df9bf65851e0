"""The pinned third-party sources the compatibility tests run (NxD 2.29, NxDT 2.26, optimum-neuron), and the
stand-ins for the modules they import that cannot be installed here.

Where they live: ``NXD_CKPT_THIRDPARTY`` (a test-only variable) or ``../shared/thirdparty`` beside the repository
(CI has it). ``missing(...)`` says what is absent, for a skip message. The stubs are modules made in memory:

* Neuron SDK (hardware only): ``torch_neuronx.utils.get_platform_target`` (answers ``"trn1"``) and
  ``neuronxcc.nki._private_kernels.collectives.CollectivesConfig``, which NxD's ``parallel_state`` imports;
  ``neuronx_distributed.kernels.flash_attn.nki_flash_attn_func`` (NKI kernels, left out of the pinned NxD tree);
* torch-xla 2.9 dropped ``xla_env_vars.HOST_WORLD_SIZE``, which NxD reads off the Neuron device
  (``shim_torch_xla_for_nxd`` names it again, with one host);
* NeMo (``install_nemo_stubs``): ``nemo.utils.{AppState, logging}`` and ``Float16Module``, imported by NxDT's
  ``nlp_overrides``; and NxDT's own ``neuronx_distributed_training.utils.{get_lnc_size, get_attribute_from_cfg}``
  (its package ``__init__``, not among the pinned files).

None of them takes part in checkpointing: every checkpoint call the tests make runs the third-party code itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

THIRDPARTY_ENV = "NXD_CKPT_THIRDPARTY"
_PREFIXES = ("torch_neuronx", "neuronxcc", "neuronx_distributed", "neuronx_distributed_training", "nemo", "optimum")
"""Top-level packages these helpers import or stub: dropped again by ``isolated()``."""
NXD = "neuronx-distributed-2.29"
NXDT = "neuronx-distributed-training-2.26"
OPTIMUM = "optimum-neuron"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def root() -> str:
    """The folder holding the pinned sources (it may not exist)."""
    return os.environ.get(THIRDPARTY_ENV) or os.path.normpath(os.path.join(_REPO, "..", "shared", "thirdparty"))


def path(folder: str) -> str:
    return os.path.join(root(), folder)


def source_root(folder: str) -> str:
    """The directory to put on ``sys.path`` for one pinned project."""
    return os.path.join(path(folder), "src") if folder == NXDT else path(folder)


def missing(*folders: str) -> str | None:
    """Why the tests needing ``folders`` cannot run (a skip reason), or None."""
    absent = [f for f in folders if not os.path.isdir(path(f))]
    if not absent:
        return None
    return (
        f"needs the pinned third-party sources {', '.join(absent)} in {root()} (CI has ../shared/thirdparty beside "
        f"the clone; {THIRDPARTY_ENV}=DIR points elsewhere)"
    )


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    """A stand-in module in ``sys.modules`` (kept if a real one is already imported), attached to its parent."""
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name, "stand-in from harness.thirdparty")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        if package:
            module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


class CollectivesConfig:
    """Stand-in for NKI's collectives configuration: NxD's ``parallel_state`` reads only the ring pairs of each
    rank's context-parallel group (for ring attention kernels)."""

    def __init__(self, replica_groups: list[list[int]]) -> None:
        self.rank_src_tgt_pairs = {
            rank: [(group[i], group[(i + 1) % len(group)]) for i in range(len(group))]
            for group in replica_groups
            for rank in group
        }


def install_neuron_stubs() -> None:
    """The Neuron SDK modules NxD's checkpoint path imports (see the module docstring)."""
    _module("torch_neuronx", package=True)
    _module("torch_neuronx.utils", get_platform_target=lambda: "trn1")
    for name in ("neuronxcc", "neuronxcc.nki", "neuronxcc.nki._private_kernels"):
        _module(name, package=True)
    _module("neuronxcc.nki._private_kernels.collectives", CollectivesConfig=CollectivesConfig)


def shim_torch_xla_for_nxd() -> None:
    """NxD 2.29 sizes its save/load worker waves off the Neuron device by ``xr.world_size() //
    os.environ[xenv.HOST_WORLD_SIZE]`` (``parallel_layers/utils.get_local_world_size``); torch-xla 2.9 no longer
    names that variable. Name it again, for one host (a world of one process here)."""
    import torch_xla.core.xla_env_vars as xenv

    if not hasattr(xenv, "HOST_WORLD_SIZE"):
        xenv.HOST_WORLD_SIZE = "HOST_WORLD_SIZE"
    os.environ.setdefault(xenv.HOST_WORLD_SIZE, "1")


def add_to_path(*folders: str) -> None:
    """Put the pinned projects first on ``sys.path`` (idempotent)."""
    for folder in reversed(folders):
        entry = source_root(folder)
        if entry not in sys.path:
            sys.path.insert(0, entry)


def import_nxd() -> types.ModuleType:
    """NxD 2.29's real ``neuronx_distributed.trainer.checkpoint`` (with the Neuron stubs)."""
    install_neuron_stubs()
    shim_torch_xla_for_nxd()
    add_to_path(NXD)
    module = importlib.import_module("neuronx_distributed.trainer.checkpoint")
    if not module.__file__.startswith(path(NXD)):
        raise RuntimeError(f"neuronx_distributed came from {module.__file__}, not from the pinned {path(NXD)}")
    return module


def install_nki_kernel_stub() -> None:
    """``neuronx_distributed.kernels.flash_attn`` (NKI kernels, not in the pinned tree), for optimum-neuron."""
    import neuronx_distributed

    kernels = _module("neuronx_distributed.kernels", package=True)
    neuronx_distributed.kernels = kernels

    def nki_flash_attn_func(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("NKI flash attention needs a Neuron device")

    _module("neuronx_distributed.kernels.flash_attn", nki_flash_attn_func=nki_flash_attn_func)


def install_nemo_stubs() -> None:
    """NeMo's names that NxDT's ``nlp_overrides`` imports, and NxDT's own ``utils`` package helpers."""
    import torch

    class AppState:
        """Stand-in for NeMo's process-wide singleton of parallel sizes."""

        _instance: AppState | None = None

        def __new__(cls) -> AppState:
            if cls._instance is None:
                cls._instance = super().__new__(cls)
            return cls._instance

    class Float16Module(torch.nn.Module):
        """Stand-in for NeMo's half-precision wrapper module."""

    for name in ("nemo", "nemo.collections", "nemo.collections.nlp", "nemo.collections.nlp.modules"):
        _module(name, package=True)
    for name in ("nemo.collections.nlp.modules.common", "nemo.collections.nlp.modules.common.megatron"):
        _module(name, package=True)
    _module("nemo.collections.nlp.modules.common.megatron.module", Float16Module=Float16Module)
    _module("nemo.utils", package=True, AppState=AppState, logging=logging.getLogger("nemo"))
    add_to_path(NXDT)
    package = _module("neuronx_distributed_training", package=True)
    package.__path__ = [os.path.join(source_root(NXDT), "neuronx_distributed_training")]
    _module(
        "neuronx_distributed_training.utils",
        package=True,
        get_lnc_size=lambda lnc=None: 1 if lnc is None else int(lnc),
        get_attribute_from_cfg=lambda cfg, attr, default=None: getattr(cfg, attr, default),
    ).__path__ = [os.path.join(source_root(NXDT), "neuronx_distributed_training", "utils")]


@contextmanager
def isolated() -> Iterator[None]:
    """Undo on exit what the helpers above did to the process: the modules of ``_PREFIXES`` imported or stubbed
    inside leave ``sys.modules`` and ``sys.path`` is restored, so later tests see no NxD and no Neuron SDK
    (a stubbed ``torch_neuronx`` would make nxd_ckpt build trn1's groups)."""
    path_before = list(sys.path)
    modules_before = set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = path_before
        for name in [n for n in sys.modules if n not in modules_before]:
            if name.split(".", 1)[0] in _PREFIXES:
                del sys.modules[name]
