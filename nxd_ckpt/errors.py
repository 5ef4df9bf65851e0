"""Exceptions raised by nxd_ckpt. Every message names the path, tag or key involved and what to do."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error nxd_ckpt raises on purpose.

    ``origin_rank`` is the global rank where the failure happened when it was raised by a collective step or
    the commit (the same exception type is raised on every rank; see ``dist.py``), else None.
    """

    origin_rank: int | None = None


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


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A phase of a save or load passed its deadline (``NXD_CKPT_TIMEOUT_S`` or ``timeout=``).

    ``phase`` names the step; ``missing_ranks`` are the ranks that had not arrived there (empty when this rank
    itself was the one too slow, e.g. its storage); ``path`` and ``bytes_moved`` name the file a storage call
    was on and how far it got.
    """

    def __init__(
        self,
        message: str,
        phase: str | None = None,
        missing_ranks: tuple[int, ...] | list[int] = (),
        path: str | None = None,
        bytes_moved: int | None = None,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.missing_ranks = tuple(missing_ranks)
        self.path = path
        self.bytes_moved = bytes_moved

    def __str__(self) -> str:  # TimeoutError (an OSError) would otherwise format its args itself
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.phase, self.missing_ranks, self.path, self.bytes_moved))


class StorageStallError(CheckpointTimeoutError, StorageError):
    """A storage call made no progress (no bytes moved, no call returned) for the stall limit: a hung mount,
    a lost connection or a blocked device. The call itself may still be stuck in the kernel; nxd_ckpt stops
    waiting for it and raises this instead."""


class AsyncSaveError(CheckpointError):
    """A background save failed; the original exception is chained as ``__cause__``."""


class RemoteRankError(CheckpointError):
    """Another rank failed during a collective checkpoint step; its message is included."""


class DeviceUnavailableError(CheckpointError, RuntimeError):
    """A device was asked for (e.g. ``xla``) whose runtime is not installed in this environment."""


class MemoryTierFullError(CheckpointError):
    """The memory tier cannot hold the next save within its budget (raised before anything is staged)."""


class ReshardError(LayoutMismatchError):
    """A tensor cannot be moved to the requested TP/PP layout (its sharding is unsupported, or not known)."""


class MissingFileError(IntegrityError, FileNotFoundError):
    """A file the checkpoint's records list is not there (deleted, or not yet visible on a shared file system)."""
