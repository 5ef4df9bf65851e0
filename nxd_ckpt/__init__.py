"""nxd_ckpt: fast, crash-consistent checkpoints for PyTorch/XLA training, in NeuronX Distributed's layout."""

from typing import TYPE_CHECKING, Any

from nxd_ckpt.errors import (
    AsyncSaveError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    DeviceUnavailableError,
    FormatError,
    IntegrityError,
    InvalidTagError,
    LayoutMismatchError,
    MemoryTierFullError,
    RemoteRankError,
    ReshardError,
    StateMismatchError,
    StorageError,
    StorageStallError,
    UnsafeCheckpointError,
)
from nxd_ckpt.log import enable_logging

# Everything that needs torch is imported on first use (PEP 562), so ``nxd-ckpt list`` and ``--help`` start
# without importing torch; ``import nxd_ckpt`` followed by any of these names behaves as an eager import. Once
# torch is imported, ``import nxd_ckpt`` imports the API itself (``_import_api_with_torch``, at the end).
_LAZY = {
    "finalize_checkpoint": "api",
    "prepare_async_save": "api",
    "g_iostate": "compat",
    "get_manager": "api",
    "has_checkpoint": "api",
    "latest_checkpoint_tag": "api",
    "list_checkpoint_tags": "api",
    "load_checkpoint": "api",
    "reset_manager": "api",
    "save_checkpoint": "api",
    "Checkpoint": "inspection",
    "open_checkpoint": "inspection",
    "CheckpointManager": "manager",
    "SaveReport": "save.report",
    "SaveOptions": "options",
    "LoadOptions": "options",
    "RestoreReport": "load.report",
    "MemoryTier": "tier.memory",
    "destroy_model_parallel": "parallel_state",
    "initialize_model_parallel": "parallel_state",
    "Topology": "ranks.topology",
    "ShardingRecord": "format.sharding",
    "TensorSharding": "format.sharding",
    "VerifyReport": "tools.verification",
    "verify": "tools.verification",
    "register_zero1_optimizer": "optimizers",
}

if TYPE_CHECKING:
    from nxd_ckpt.api import (
        finalize_checkpoint,
        get_manager,
        has_checkpoint,
        latest_checkpoint_tag,
        list_checkpoint_tags,
        load_checkpoint,
        prepare_async_save,
        reset_manager,
        save_checkpoint,
    )
    from nxd_ckpt.compat import g_iostate
    from nxd_ckpt.format.sharding import ShardingRecord, TensorSharding
    from nxd_ckpt.inspection import Checkpoint, open_checkpoint
    from nxd_ckpt.load.report import RestoreReport
    from nxd_ckpt.manager import CheckpointManager
    from nxd_ckpt.optimizers import register_zero1_optimizer
    from nxd_ckpt.options import LoadOptions, SaveOptions
    from nxd_ckpt.parallel_state import destroy_model_parallel, initialize_model_parallel
    from nxd_ckpt.ranks.topology import Topology
    from nxd_ckpt.save.report import SaveReport
    from nxd_ckpt.tier.memory import MemoryTier
    from nxd_ckpt.tools.verification import VerifyReport, verify


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nxd_ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AsyncSaveError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "DeviceUnavailableError",
    "FormatError",
    "IntegrityError",
    "InvalidTagError",
    "LayoutMismatchError",
    "LoadOptions",
    "MemoryTier",
    "MemoryTierFullError",
    "RemoteRankError",
    "ReshardError",
    "RestoreReport",
    "SaveOptions",
    "SaveReport",
    "ShardingRecord",
    "StateMismatchError",
    "StorageError",
    "StorageStallError",
    "TensorSharding",
    "Topology",
    "UnsafeCheckpointError",
    "VerifyReport",
    "destroy_model_parallel",
    "enable_logging",
    "finalize_checkpoint",
    "g_iostate",
    "get_manager",
    "has_checkpoint",
    "initialize_model_parallel",
    "latest_checkpoint_tag",
    "list_checkpoint_tags",
    "load_checkpoint",
    "open_checkpoint",
    "prepare_async_save",
    "register_zero1_optimizer",
    "reset_manager",
    "save_checkpoint",
    "verify",
]


def _import_api_with_torch() -> None:
    """A training script that imported torch before nxd_ckpt gets the API (and everything a save or a load
    imports) now, at its own imports, rather than inside its first ``save_checkpoint`` call: that import is the
    one cost of a process's first save besides new staging memory (0.07-0.12 s with bytecode caches, 0.3-0.5 s
    without; ``python -m benchmarks first_save``). Without torch loaded (the command line) the names stay lazy, and
    a failing import is left for the first use to raise, as before."""
    import contextlib
    import sys

    if "torch" in sys.modules:
        with contextlib.suppress(ImportError):
            from nxd_ckpt import api  # noqa: F401


_import_api_with_torch()
