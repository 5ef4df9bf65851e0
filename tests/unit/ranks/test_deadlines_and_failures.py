"""Deadlines, the storage watchdog and cross-rank failures, in one process (no process group needed)."""

from __future__ import annotations

import ast
import contextlib
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import pytest

import nxd_ckpt as nxd
from nxd_ckpt.errors import CheckpointTimeoutError, RemoteRankError, StorageStallError
from nxd_ckpt.ranks import coordinator as dist
from nxd_ckpt.ranks.deadlines import resolve_timeout
from nxd_ckpt.ranks.failures import RankFailure, raise_failures
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.fakes import make_training

PACKAGE = pathlib.Path(nxd.__file__).parent


# ------------------------------------------------------------------------------------------ one owner
def _imports_torch_distributed(source: str) -> list[int]:
    """Lines of ``source`` that import torch.distributed or reach it as ``torch.distributed``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("torch.distributed") or (
                node.module == "torch" and any(a.name == "distributed" for a in node.names)
            ):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


_DCP_FILE_FORMAT = "tools/dcp_io.py"
"""The one module that reads and writes torch Distributed Checkpoint *files* (export/import, NxD's use_zero1_dcp
state): it may import ``torch.distributed.checkpoint`` and nothing else of torch.distributed, and it always runs
DCP without a process group (``no_dist=True``)."""

_DCP_STORAGE = "dcp/"
"""DCP's storage writer and reader (``nxd_ckpt.dcp``): DCP calls them on every rank; they import only
``torch.distributed.checkpoint``; their cross-rank steps (the memory tier's, the commit's check-in) go through
ranks/."""


_TORCHTITAN = "torchtitan/"
"""TorchTitan's checkpoint manager (``nxd_ckpt.torchtitan``): it runs DCP's saves and loads over the job's process
group (DCP's collectives), importing only ``torch.distributed.checkpoint``; its own groups come from ranks/."""


def _dcp_imports_only(source: str) -> bool:
    """Every torch.distributed import of ``source`` is torch.distributed.checkpoint."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.module.startswith("torch."):
            names = [node.module] if node.module.startswith("torch.distributed") else []
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                return False
        else:
            continue
        if any(not n.startswith("torch.distributed.checkpoint") for n in names):
            return False
    return True


def _dcp_file_format_only(source: str) -> bool:
    """Every torch.distributed import of ``source`` is torch.distributed.checkpoint, and DCP runs with no_dist."""
    if not _dcp_imports_only(source):
        return False
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]

    def is_dcp(value: ast.expr) -> bool:  # ``dcp.save`` or ``_dcp().load``
        if isinstance(value, ast.Call):
            value = value.func
        return isinstance(value, ast.Name) and value.id in ("dcp", "_dcp")

    dcp_calls = [
        c
        for c in calls
        if isinstance(c.func, ast.Attribute) and c.func.attr in ("save", "load") and is_dcp(c.func.value)
    ]
    return all(any(k.arg == "no_dist" for k in c.keywords) for c in dcp_calls)


def test_only_dist_talks_to_torch_distributed():
    """Every collective, process group and store of the library comes from nxd_ckpt/ranks/coordinator.py (the
    store protocol, ``ranks/arrivals.py``, works on the store it hands out; the test harness that starts process
    groups, run_with_ranks, is harness/, outside the package). Excluded: the DCP file-format module and DCP's
    storage writer and reader (``nxd_ckpt/dcp/``), as long as they use only torch.distributed.checkpoint, without a
    process group of their own, and TorchTitan's manager (``nxd_ckpt/torchtitan/``), which runs DCP over the job's
    process group and imports only torch.distributed.checkpoint."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "ranks/coordinator.py":
            continue
        if (rel == _DCP_FILE_FORMAT or rel.startswith(_DCP_STORAGE)) and _dcp_file_format_only(path.read_text()):
            continue
        if rel.startswith(_TORCHTITAN) and _dcp_imports_only(path.read_text()):
            continue
        lines = _imports_torch_distributed(path.read_text())
        if lines:
            offenders[rel] = lines
    assert offenders == {}, f"only nxd_ckpt/ranks/coordinator.py may use torch.distributed; also used in {offenders}"


def test_the_dcp_exception_is_narrow():
    assert _dcp_file_format_only("import torch.distributed.checkpoint as dcp\ndcp.save(x, no_dist=True)")
    assert not _dcp_file_format_only("import torch.distributed.checkpoint as dcp\ndcp.save(x)")
    assert not _dcp_file_format_only("import torch.distributed as dist")
    assert not _dcp_file_format_only("from torch.distributed import barrier")


def test_the_grep_finds_every_spelling():
    assert _imports_torch_distributed("import torch.distributed as d") == [1]
    assert _imports_torch_distributed("from torch.distributed import barrier") == [1]
    assert _imports_torch_distributed("from torch import distributed") == [1]
    assert _imports_torch_distributed("import torch\nx = torch.distributed.get_rank()") == [2]
    assert _imports_torch_distributed("'''torch.distributed in a docstring'''") == []


# ------------------------------------------------------------------------------------------ the knob
def test_timeout_comes_from_the_keyword_else_the_environment(monkeypatch):
    monkeypatch.delenv("NXD_CKPT_TIMEOUT_S", raising=False)
    monkeypatch.delenv("NXD_CKPT_COMMIT_TIMEOUT_S", raising=False)
    assert resolve_timeout(None) == 1800.0
    monkeypatch.setenv("NXD_CKPT_COMMIT_TIMEOUT_S", "600")  # the older name still works
    assert resolve_timeout(None) == 600.0
    monkeypatch.setenv("NXD_CKPT_TIMEOUT_S", "45")
    assert resolve_timeout(None) == 45.0
    assert resolve_timeout(2.5) == 2.5
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            resolve_timeout(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("NXD_CKPT_TIMEOUT_S", "ten")
    with pytest.raises(ValueError, match="NXD_CKPT_TIMEOUT_S='ten' is not valid"):
        resolve_timeout(None)


def test_save_and_load_reject_a_bad_timeout(tmp_path):
    model, _, _ = make_training(seed=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        nxd.save_checkpoint(str(tmp_path), "step_1", model=model, timeout=0)
    nxd.save_checkpoint(str(tmp_path), "step_1", model=model, timeout=30)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        nxd.load_checkpoint(str(tmp_path), model=model, timeout=-5)
    nxd.load_checkpoint(str(tmp_path), model=model, timeout=30)


# ------------------------------------------------------------------------------------------ failures
class _TwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a + b)


def test_a_failure_is_rebuilt_as_its_own_type_with_the_origin_rank():
    error = RankFailure.of(nxd.UnsafeCheckpointError("refusing class x.Y"), 3, "reading rank state").to_exception()
    assert type(error) is nxd.UnsafeCheckpointError and error.origin_rank == 3
    assert str(error) == "rank 3 failed while reading rank state: refusing class x.Y"
    timeout = CheckpointTimeoutError("late", phase="commit", missing_ranks=[5], path="t/a.pt", bytes_moved=7)
    rebuilt = RankFailure.of(timeout, 0, "commit").to_exception()
    assert type(rebuilt) is CheckpointTimeoutError
    assert (rebuilt.phase, rebuilt.missing_ranks, rebuilt.path, rebuilt.bytes_moved) == ("commit", (5,), "t/a.pt", 7)
    assert type(RankFailure.of(OSError(28, "No space left"), 1, "writing").to_exception()) is OSError
    # A type that cannot be rebuilt from a message, or that is no Exception, arrives as RemoteRankError.
    odd = RankFailure.of(_TwoArgs("a", "b"), 2, "writing").to_exception()
    assert type(odd) is RemoteRankError and "_TwoArgs: ab" in str(odd) and odd.origin_rank == 2
    interrupted = RankFailure.of(KeyboardInterrupt(), 1, "writing").to_exception()
    assert type(interrupted) is RemoteRankError


def test_every_rank_raises_the_lowest_failing_ranks_error():
    failures = [None, RankFailure.of(ValueError("one"), 1, "x"), RankFailure.of(KeyError("two"), 2, "x")]
    # Rank 0 did not fail: it raises rank 1's type, naming the others.
    with pytest.raises(ValueError, match=r"rank 1 failed while x: one \(rank\(s\) \[2\] failed too\)"):
        raise_failures(failures, None, 0)
    # Rank 1 raises its own exception object, marked with its rank.
    own = ValueError("one")
    with pytest.raises(ValueError) as raised:
        raise_failures(failures, own, 1)
    assert raised.value is own and own.origin_rank == 1  # type: ignore[attr-defined]
    # Rank 2 failed too, differently: it raises rank 1's type, chained to its own.
    mine = KeyError("two")
    with pytest.raises(ValueError) as raised:
        raise_failures(failures, mine, 2)
    assert raised.value.__cause__ is mine
    raise_failures([None, None], None, 0)  # nothing failed: nothing raised


def test_a_world_of_one_runs_steps_locally():
    coord = dist.Coordinator()
    assert (coord.rank, coord.world_size, coord.store) == (0, 1, None)
    assert coord.master_computes(lambda: 41 + 1, "computing") == 42
    assert coord.run_all(lambda: "ok", "running") == "ok"
    with pytest.raises(nxd.FormatError, match="broken"):
        coord.master_computes(lambda: (_ for _ in ()).throw(nxd.FormatError("broken")), "computing")
    coord.barrier("nothing to wait for")
    assert coord.all_gather_object(5) == [5]
    assert coord.gather_and_master_computes("mine", lambda: 7, "both") == (["mine"], 7)
    with pytest.raises(nxd.FormatError, match="broken"):
        coord.gather_and_master_computes(1, lambda: (_ for _ in ()).throw(nxd.FormatError("broken")), "both")


# ------------------------------------------------------------------------------------------ the watchdog
class SlowStorage(LocalStorage):
    """Local storage whose writes of ``match`` files stop (``chunk_delay_s=None``) or crawl along."""

    def __init__(self, root: str, match: str, chunk_delay_s: float | None) -> None:
        super().__init__(root)
        self.match = match
        self.chunk_delay_s = chunk_delay_s
        self.release = threading.Event()

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with super().open_write(path) as f:
            yield _SlowStream(self, f) if self.match in path else f  # type: ignore[misc]


class _SlowStream:
    def __init__(self, owner: SlowStorage, target: BinaryIO) -> None:
        self._owner, self._target = owner, target

    def write(self, data: Any) -> int:
        # A hung call moves nothing until released; a crawling one takes chunk_delay_s for every write call
        # (torch.save issues one per record): progress, but the file never finishes in time.
        self._owner.release.wait(60 if self._owner.chunk_delay_s is None else self._owner.chunk_delay_s)
        return self._target.write(data)

    def flush(self) -> None:
        self._target.flush()


def test_a_storage_call_without_progress_is_a_stall(tmp_path):
    storage = SlowStorage(str(tmp_path), match="model/", chunk_delay_s=None)
    model, opt, _ = make_training(seed=0)
    start = time.monotonic()
    try:
        with pytest.raises(StorageStallError) as raised:
            nxd.save_checkpoint(storage, "step_1", model=model, optimizer=opt, timeout=1.0)
    finally:
        storage.release.set()
    assert time.monotonic() - start < 5
    error = raised.value
    assert error.path is not None and error.path.startswith("step_1/model/") and error.bytes_moved == 0
    assert "no progress" in str(error) and error.path in str(error)
    assert nxd.latest_checkpoint_tag(str(tmp_path)) is None


def test_a_file_write_that_crawls_past_the_deadline_times_out(tmp_path):
    storage = SlowStorage(str(tmp_path), match="model/", chunk_delay_s=0.2)
    model, opt, _ = make_training(seed=0)
    nxd.save_checkpoint(str(tmp_path), "step_0", model=model, optimizer=opt)
    start = time.monotonic()
    try:
        with pytest.raises(CheckpointTimeoutError) as raised:
            nxd.save_checkpoint(storage, "step_1", model=model, optimizer=opt, timeout=1.0)
    finally:
        storage.release.set()
    assert time.monotonic() - start < 5
    error = raised.value
    assert not isinstance(error, StorageStallError)  # it moved bytes all along: slow, not stalled
    assert error.path is not None and error.path.startswith("step_1/model/") and error.bytes_moved > 0
    assert f"({error.bytes_moved} bytes moved)" in str(error) and "did not finish within 1 s" in str(error)
    assert nxd.latest_checkpoint_tag(str(tmp_path)) == "step_0"
    # The abandoned writer starts no further storage call, and the next save works.
    nxd.save_checkpoint(str(tmp_path), "step_2", model=model, optimizer=opt)
    assert nxd.latest_checkpoint_tag(str(tmp_path)) == "step_2"


# ------------------------------------------------------------------------------------------ the commit barrier
def _stores(world: int) -> list[Any]:
    """A real TCPStore server on 127.0.0.1 and one client per simulated rank."""
    import datetime

    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=30)
    server = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", server.port, world, is_master=False, timeout=timeout) for _ in range(world)]
    return [server, *clients]


def test_commit_barrier_names_the_rank_that_never_arrives(caplog):
    from nxd_ckpt.save.barrier import CommitBarrier

    _, *clients = stores = _stores(3)
    barriers = [CommitBarrier(clients[r], "s", 1, r, 3, timeout_s=1.0, tag="step_9") for r in range(3)]
    outcome: dict[str, BaseException] = {}

    def rank_1() -> None:
        barriers[1].arrive(None)
        try:
            barriers[1].wait_outcome()
        except BaseException as e:
            outcome["rank 1"] = e

    thread = threading.Thread(target=rank_1)
    thread.start()
    barriers[0].arrive(None)  # rank 2 never arrives (stuck in a write)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="nxd_ckpt"), pytest.raises(CheckpointTimeoutError) as raised:
        barriers[0].wait_all_arrived()
    assert time.monotonic() - start < 3
    assert raised.value.missing_ranks == (2,) and raised.value.phase.startswith("commit of 'step_9'")
    assert "waiting for rank(s) [2] in phase 'commit of 'step_9'" in caplog.text
    barriers[0].publish_outcome(RankFailure.of(raised.value, 0, barriers[0].phase))
    thread.join(10)
    assert type(outcome["rank 1"]) is CheckpointTimeoutError and outcome["rank 1"].missing_ranks == (2,)
    del stores


def test_commit_barrier_carries_the_failure_type_to_every_rank():
    from nxd_ckpt.save.barrier import CommitBarrier

    _, *clients = stores = _stores(3)
    barriers = [CommitBarrier(clients[r], "s", 1, r, 3, timeout_s=10.0, tag="step_9") for r in range(3)]
    barriers[1].arrive(nxd.UnsafeCheckpointError("refusing class evil.Payload"))
    barriers[2].arrive(None)
    barriers[0].arrive(None)
    failures = barriers[0].wait_all_arrived()
    assert list(failures) == [1] and failures[1].qualname == "UnsafeCheckpointError"
    barriers[0].publish_outcome(failures[1])
    with pytest.raises(nxd.UnsafeCheckpointError, match="rank 1 failed while writing 'step_9': refusing") as raised:
        barriers[2].wait_outcome()
    assert raised.value.origin_rank == 1
    del stores
