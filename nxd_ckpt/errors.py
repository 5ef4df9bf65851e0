"""Exceptions raised by nxd_ckpt. Every message names the path, tag or key involved and what to do."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error nxd_ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for."""


class InvalidTagError(CheckpointError, ValueError):
    """A tag or another name that would become a path is not a plain name."""


class LayoutMismatchError(CheckpointError):
    """The checkpoint was saved with a different TP/PP (or world) layout than the current one."""


class StateMismatchError(CheckpointError):
    """Saved state does not fit the target: missing/unexpected keys or wrong shapes."""


class FormatError(CheckpointError):
    """A file is missing, truncated or inconsistent with the checkpoint format."""


class IntegrityError(FormatError):
    """A file's checksum does not match the one recorded when it was written."""


class UnsafeCheckpointError(CheckpointError):
    """Loading would need to run code from the checkpoint (pickled classes) without an explicit opt-in."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed (after retries where the backend retries)."""


class AsyncSaveError(CheckpointError):
    """A background save failed; the original exception is chained as ``__cause__``."""


class RemoteRankError(CheckpointError):
    """Another rank failed during a collective checkpoint step; its message is included."""


class DeviceUnavailableError(CheckpointError, RuntimeError):
    """A device was asked for (e.g. ``xla``) whose runtime is not installed in this environment."""
