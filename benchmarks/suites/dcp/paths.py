"""The save and load paths the dcp suite compares on one state: stock DCP (``dcp.save``, ``dcp.async_save``, and
``async_save`` through a ``DefaultStager``), Meta's ``torch_checkpointing`` and nxd_ckpt's ``StorageWriter`` +
``Stager``. A save runs until durable and reports the seconds it blocked the caller and the seconds to durable."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from benchmarks.core.devices import Device, default_stager_options, host_state
from benchmarks.core.files import fsync_tree, remove

TC_NO_DIRECT_IO = (
    "torch_checkpointing's default O_DIRECT writes fail here (EINVAL: torch.save's unaligned writes), so it "
    "writes buffered (LocalFileSystemStorageConfig(use_direct_io=False))"
)


def failures() -> tuple[type[BaseException], ...]:
    """What a failed save raises: any Exception, and DCP's CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def first_line(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@dataclasses.dataclass
class Saved:
    """One save's figures: seconds until the caller may change the state, and until the checkpoint is durable."""

    blocked_s: float
    durable_s: float


class SavePath:
    """One way of saving the state into a fresh folder, until durable. ``reads_as`` names the load that reads its
    files; ``notes`` say how it was run where that differs from its defaults or from the others."""

    key = ""
    label = ""

    def __init__(self, dev: Device | None) -> None:
        self.dev = dev
        self.notes: list[str] = []
        self.via_host: str | None = None
        """Why this path gets host copies of device state (made inside the timed call), or None."""

    def given(self, state: Any) -> Any:
        """The state this path is handed inside its timed call: host copies (one bulk transfer) where it refuses
        device tensors, else the state itself."""
        return host_state(self.dev, state) if self.via_host and self.dev is not None else state

    def save(self, state: Any, folder: str) -> Saved:
        """Save ``state`` into ``folder`` until durable. On XLA state a path that refuses device tensors is given
        host copies from then on (said in its notes), as a DCP user on XLA would do."""
        try:
            return self._save(state, folder)
        except failures() as e:
            if self.dev is None or self.dev.kind != "xla" or self.via_host:
                raise
            self.via_host = first_line(e)
            self.notes.append(f"refused the XLA state ({self.via_host}): given host copies, one bulk transfer "
                              "timed inside the call")  # fmt: skip
            remove(folder)
            return self._save(state, folder)

    def _save(self, state: Any, folder: str) -> Saved:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the path keeps across saves."""


def awaited(response: Any, start: float, wait_staging: bool) -> Saved:
    """An async save's figures: blocked until the call returned (and, with ``wait_staging``, until its staging
    completed: the live state may change only then), durable when its upload is done."""
    blocked = time.perf_counter() - start
    staging = getattr(response, "staging_completion", None)
    if wait_staging and staging is not None:
        staging.result()
        blocked = time.perf_counter() - start
    getattr(response, "upload_completion", response).result()
    return Saved(blocked, time.perf_counter() - start)


class DcpSync(SavePath):
    """Stock ``dcp.save`` through ``FileSystemWriter(sync_files=True)``."""

    key, label = "dcp_sync", "DCP dcp.save (FileSystemWriter, sync_files=True)"

    def _save(self, state: Any, folder: str) -> Saved:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        dcp.save(self.given(state), storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
        elapsed = time.perf_counter() - start
        return Saved(elapsed, elapsed)


class DcpAsync(SavePath):
    """Stock ``dcp.async_save`` with its own default staging."""

    key, label = "dcp_async", "DCP dcp.async_save (FileSystemWriter, sync_files=True)"

    def _save(self, state: Any, folder: str) -> Saved:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        writer = dcp.FileSystemWriter(folder, sync_files=True)
        return awaited(dcp.async_save(self.given(state), storage_writer=writer), start, wait_staging=True)


class DcpStager(SavePath):
    """Stock ``dcp.async_save`` through one ``DefaultStager`` kept across saves: pinned memory and non-blocking
    copies where CUDA is (DCP pins only there), never shared memory, staging inside the call. Where reusing it fails
    (torch 2.11: ``KeyError: <class 'type'>`` on the second save) every later save gets a new one."""

    key, label = "dcp_stager", "DCP dcp.async_save + DefaultStager"

    def __init__(self, dev: Device | None) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # ImportError: no stager

        super().__init__(dev)
        cuda = dev is not None and dev.kind == "cuda"
        options = default_stager_options(cuda)
        self.make: Callable[[], Any] = lambda: DefaultStager(StagingOptions(**options))
        self.stager = self.make()
        self.fresh: str | None = None
        self.saves = 0
        self.notes.append(f"StagingOptions({', '.join(f'{k}={v}' for k, v in options.items())})"
                          + ("" if cuda else ": pinned memory needs CUDA"))  # fmt: skip

    def _save(self, state: Any, folder: str) -> Saved:
        import torch.distributed.checkpoint as dcp

        if self.fresh:
            self.stager.close()  # untimed: the previous stager's buffers
            self.stager = self.make()
        try:
            start = time.perf_counter()
            writer = dcp.FileSystemWriter(folder, sync_files=True)
            response = dcp.async_save(self.given(state), storage_writer=writer, async_stager=self.stager)
            saved = awaited(response, start, wait_staging=True)
        except failures() as e:
            if self.fresh or self.saves == 0:
                raise
            self.fresh = first_line(e)
            self.notes.append(f"reusing the stager failed ({self.fresh}): a new DefaultStager for every later save")
            remove(folder)
            return self._save(state, folder)
        self.saves += 1
        return saved

    def close(self) -> None:
        self.stager.close()


class TorchCheckpointing(SavePath):
    """Meta's ``torch_checkpointing.CheckpointManager`` with its default async saver (staging on a thread into
    shared memory, pinned only on CUDA; the files written by a spawned process). Blocked: until ``save`` returned
    and its staging ended (``with manager.lock():``, which an optimizer step takes); durable: its future done, then
    an fsync of its folder, which it does not do itself (timed: it is part of being durable)."""

    key, label = "tc_async", "torch_checkpointing CheckpointManager.save (async) + fsync"

    def __init__(self, dev: Device | None) -> None:
        from torch_checkpointing import CheckpointManager  # ImportError: not installed here
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        super().__init__(dev)
        config = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
        self.manager = CheckpointManager(config)
        self.notes += [TC_NO_DIRECT_IO, "no resharder declared: each rank writes all of its items (a replicated "
                       "model once per rank); it does not fsync: the suite fsyncs its folder, timed"]  # fmt: skip

    def _save(self, state: Any, folder: str) -> Saved:
        start = time.perf_counter()
        future = self.manager.save(folder, self.given(state))
        with self.manager.lock():
            blocked = time.perf_counter() - start
        if future is not None:
            future.result()
        fsync_tree(folder)
        return Saved(blocked, time.perf_counter() - start)

    def load(self, live: Any, folder: str) -> None:
        """Its load into the live state (in place)."""
        self.manager.load(folder, into=live)

    def close(self) -> None:
        self.manager.close()


class NxdAsync(SavePath):
    """``dcp.async_save`` through ``nxd_ckpt.dcp.StorageWriter`` and one ``nxd_ckpt.dcp.Stager`` kept across saves:
    the live state may change once the call returns; durable when the upload (checksums, fsync, the ``.metadata``
    commit) is done."""

    key, label = "nxd_async", "nxd dcp.async_save + nxd StorageWriter + nxd Stager"

    def __init__(self, dev: Device | None) -> None:
        import nxd_ckpt.dcp

        super().__init__(dev)
        self.stager = nxd_ckpt.dcp.Stager()

    def _save(self, state: Any, folder: str) -> Saved:
        import torch.distributed.checkpoint as dcp

        import nxd_ckpt.dcp

        start = time.perf_counter()
        writer = nxd_ckpt.dcp.StorageWriter(folder)
        response = dcp.async_save(self.given(state), storage_writer=writer, async_stager=self.stager)
        return awaited(response, start, wait_staging=False)

    def close(self) -> None:
        self.stager.close()


class NxdSync(SavePath):
    """``dcp.save`` through ``nxd_ckpt.dcp.StorageWriter``."""

    key, label = "nxd_sync", "nxd dcp.save + nxd StorageWriter"

    def _save(self, state: Any, folder: str) -> Saved:
        import torch.distributed.checkpoint as dcp

        import nxd_ckpt.dcp

        start = time.perf_counter()
        dcp.save(self.given(state), storage_writer=nxd_ckpt.dcp.StorageWriter(folder))
        elapsed = time.perf_counter() - start
        return Saved(elapsed, elapsed)


SAVE_PATHS: tuple[type[SavePath], ...] = (DcpSync, DcpAsync, DcpStager, TorchCheckpointing, NxdAsync, NxdSync)


def build_paths(dev: Device | None) -> tuple[list[SavePath], dict[str, str]]:
    """Every save path this environment has, and why each missing one is missing."""
    paths, missing = [], {}
    for cls in SAVE_PATHS:
        try:
            paths.append(cls(dev))
        except ImportError as e:
            missing[cls.key] = f"{cls.label}: not importable here ({first_line(e)})"
    return paths, missing


@dataclasses.dataclass
class LoadPath:
    """One load into the live state: of the files ``source`` (a save path's key) wrote."""

    key: str
    label: str
    source: str
    load: Callable[[Any, str], None]


def dcp_load(live: Any, folder: str) -> None:
    """Stock ``dcp.load`` through DCP's ``FileSystemReader``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(live, storage_reader=dcp.FileSystemReader(folder))


def nxd_load(live: Any, folder: str) -> None:
    """``dcp.load`` through ``nxd_ckpt.dcp.StorageReader`` (checksums verified)."""
    import torch.distributed.checkpoint as dcp

    import nxd_ckpt.dcp

    dcp.load(live, storage_reader=nxd_ckpt.dcp.StorageReader(folder))


def build_loads(paths: list[SavePath]) -> list[LoadPath]:
    """The loads whose files a save path here writes: DCP's of the stock sync save, ours of our async save, and
    torch_checkpointing's of its own."""
    have = {p.key: p for p in paths}
    loads = []
    if "dcp_sync" in have:
        loads.append(LoadPath("dcp_load", "dcp.load (FileSystemReader) of DCP's sync save", "dcp_sync", dcp_load))
    if "nxd_async" in have:
        loads.append(LoadPath("nxd_load", "dcp.load (nxd StorageReader) of nxd's async save", "nxd_async", nxd_load))
    tc = have.get("tc_async")
    if isinstance(tc, TorchCheckpointing):
        loads.append(LoadPath("tc_load", "torch_checkpointing CheckpointManager.load", "tc_async", tc.load))
    return loads
