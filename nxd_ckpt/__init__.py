"""nxd_ckpt: fast, crash-consistent checkpoints for PyTorch/XLA training, in NeuronX Distributed's layout."""

from .api import (
    finalize_checkpoint,
    get_manager,
    has_checkpoint,
    latest_checkpoint_tag,
    list_checkpoint_tags,
    load_checkpoint,
    reset_manager,
    save_checkpoint,
)
from .errors import (
    AsyncSaveError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    DeviceUnavailableError,
    FormatError,
    IntegrityError,
    InvalidTagError,
    LayoutMismatchError,
    RemoteRankError,
    StateMismatchError,
    StorageError,
    StorageStallError,
    UnsafeCheckpointError,
)
from .inspect import Checkpoint, open_checkpoint
from .log import enable_logging
from .manager import CheckpointManager, SaveReport
from .parallel_state import destroy_model_parallel, initialize_model_parallel
from .topology import Topology
from .verification import VerifyReport, verify

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
    "RemoteRankError",
    "SaveReport",
    "StateMismatchError",
    "StorageError",
    "StorageStallError",
    "Topology",
    "UnsafeCheckpointError",
    "VerifyReport",
    "destroy_model_parallel",
    "enable_logging",
    "finalize_checkpoint",
    "get_manager",
    "has_checkpoint",
    "initialize_model_parallel",
    "latest_checkpoint_tag",
    "list_checkpoint_tags",
    "load_checkpoint",
    "open_checkpoint",
    "reset_manager",
    "save_checkpoint",
    "verify",
]
