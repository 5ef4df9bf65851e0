"""The save pipeline as a whole: its steps run in the order ``save/pipeline.py`` and docs/architecture.md give
(begin -> plan -> stage -> write -> commit -> retention), the plan lists every write (per-rank state included),
``stage`` owns every copy, and ``run`` hands its results back as a ``SaveOutcome``. Ranks are threads
(``testing.threadworld``) where a step is collective."""

from __future__ import annotations

import functools
import os
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from nxd_ckpt.format import layout, manifests
from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.options import save_options
from nxd_ckpt.ranks.coordinator import Coordinator
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.save import budget, plan
from nxd_ckpt.save import capture as save_capture
from nxd_ckpt.save.context import SaveContext, SaveOutcome, SaveServices, SaveTimer
from nxd_ckpt.save.pipeline import SavePipeline
from nxd_ckpt.save.report import SaveReport
from nxd_ckpt.save.staging import StagingPool
from nxd_ckpt.save.writer import AsyncWriter
from nxd_ckpt.storage import DelegatingStorage, LocalStorage
from nxd_ckpt.testing.threadworld import ThreadWorld


class Loader:
    """A stateful data loader that notes when its state is read."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def state_dict(self) -> dict:
        self.events.append("rank state read")
        return {"position": 3}

    def load_state_dict(self, state: dict) -> None:
        pass


class _DeletionsNoted(DelegatingStorage):
    """Local storage that notes retention's deletions among the steps."""

    def __init__(self, root: str, events: list[str]) -> None:
        super().__init__(LocalStorage(root))
        self.events = events

    def delete_tree(self, path: str) -> None:
        if "/" not in path:  # a whole tag (writers also clear a stale xser dir before writing one)
            self.events.append("retention")
        self.inner.delete_tree(path)


def _note(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, events: dict[int, list[str]], rank_of: Any, done: str = ""
) -> None:
    """Wrap ``owner.name`` to note its call (and its return as ``done``, if given) in the calling rank's events."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def noted(*args: Any, **kwargs: Any) -> Any:
        rank = rank_of(*args, **kwargs)
        events[rank].append(name)
        result = original(*args, **kwargs)
        if done:
            events[rank].append(done)
        return result

    monkeypatch.setattr(owner, name, noted)


def _note_steps(monkeypatch: pytest.MonkeyPatch, events: dict[int, list[str]], write: bool = True) -> None:
    """Note the pipeline's steps; with ``write``, also the write and the commit (every rank takes the commit's
    barrier to arrive; only a step failing before the write would take it earlier)."""
    by_pipeline = lambda self, *a, **k: self.coord.rank  # noqa: E731
    for step in ("begin", "mark_tag", "plan", "hand_off", *(["write"] if write else [])):
        _note(monkeypatch, SavePipeline, step, events, by_pipeline)
    _note(monkeypatch, SavePipeline, "stage", events, by_pipeline, done="staged")
    _note(monkeypatch, save_capture, "capture", events, lambda coord, *a, **k: coord.rank)
    if write:
        _note(monkeypatch, SaveContext, "barrier", events, lambda ctx: ctx.coordinator.rank)


def test_a_save_runs_its_steps_in_the_documented_order(tmp_path, monkeypatch):
    world = ThreadWorld(2)
    events: dict[int, list[str]] = {0: [], 1: []}
    _note_steps(monkeypatch, events)
    managers = [
        CheckpointManager(
            coordinator=world.coordinator(r),
            topology=Topology(rank=r, dp_size=2),
            storage=lambda d, r=r: _DeletionsNoted(os.fspath(d), events[r]),
        )
        for r in range(2)
    ]

    def save(rank: int) -> None:
        kw = {"model": {"w": torch.ones(4)}, "rank_state": Loader(events[rank]), "num_kept_ckpts": 1}
        managers[rank].save(tmp_path, "s1", **kw)
        managers[rank].wait_retention()
        events[rank].clear()
        managers[rank].save(tmp_path, "s2", **kw)  # its retention deletes s1
        managers[rank].wait_retention()

    world.run(save)
    steps = ["begin", "capture", "rank state read", "mark_tag", "plan", "stage", "staged", "write", "barrier"]
    assert events[0] == [*steps, "retention"]  # retention: rank 0, a writer job after the commit
    assert events[1] == steps
    assert sorted(os.listdir(tmp_path)) == [".nxd-tags.json", "s2"]


@pytest.mark.parametrize("mode", ["per_rank", "gather"])
def test_the_plan_lists_every_write_rank_state_included(tmp_path, monkeypatch, mode):
    world = ThreadWorld(2)
    plans: dict[int, plan.SavePlan] = {}
    original = SavePipeline.plan

    def kept(self: SavePipeline, *args: Any) -> plan.SavePlan:
        plans[self.coord.rank] = original(self, *args)
        return plans[self.coord.rank]

    monkeypatch.setattr(SavePipeline, "plan", kept)
    managers = [
        CheckpointManager(coordinator=world.coordinator(r), topology=Topology(rank=r, dp_size=2)) for r in (0, 1)
    ]

    def save(rank: int) -> None:
        managers[rank].save(tmp_path, "t", model={"w": torch.ones(4)}, save_rng=True, rank_state_mode=mode)

    world.run(save)
    rank_files = {
        r: [(w.kind, w.path, w.replicas) for w in plans[r].rank_state_files] for r in (0, 1)
    }  # fmt: skip
    if mode == "per_rank":
        assert rank_files == {r: [("rank_state", layout.rank_state_file("t", r), (r,))] for r in (0, 1)}
    else:  # gathered to rank 0, which writes them all
        assert rank_files == {0: [("rank_state", layout.gathered_rank_states_file("t"), (0,))], 1: []}
    assert [w.kind for w in plans[0].state_files] == ["model"] and plans[1].state_files == ()
    storage = LocalStorage(str(tmp_path))
    for r in (0, 1):
        assert plans[r].writes == [*plans[r].state_files, *plans[r].rank_state_files]  # rank state last
        path = next(p for p in manifests.manifest_paths(storage, "t") if manifests.parse_manifest(
            storage.read_bytes(p), p)[0] == r)  # fmt: skip
        written = manifests.parse_manifest(storage.read_bytes(path), path)[1]
        assert {w.path.split("/", 1)[1] for w in plans[r].writes} <= set(written)


def test_budgeted_staging_hands_the_write_over_then_copies_inside_stage(tmp_path, monkeypatch):
    """Under a host memory budget ``stage`` starts the write job first and makes the copies itself."""
    events: dict[int, list[str]] = {0: []}
    _note_steps(monkeypatch, events, write=False)  # the writer thread writes while the stager copies
    _note(monkeypatch, budget.BudgetedStager, "stage", events, lambda *a: 0, done="copied")
    manager = CheckpointManager(topology=Topology(rank=0))
    state = {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}
    report = manager.save(tmp_path, "t", model=state, async_save=True, host_memory_budget=8192)
    # the pipeline's stage step: the hand-off, then the stager's copies, all before the step returns
    assert events[0] == ["begin", "capture", "mark_tag", "plan", "stage", "hand_off", "stage", "copied", "staged"]
    report.wait()
    manager.finalize()
    assert report.completed and (tmp_path / "t" / "done").exists()


def _services(tmp_path: Any, seq: int, topology: Any = None) -> SaveServices:
    return SaveServices(
        coordinator=Coordinator(),
        session="test",
        seq=seq,
        writer=AsyncWriter(),
        staging_pool=StagingPool(),
        timer=SaveTimer(),
        topology=topology or (lambda: Topology(rank=0)),
        storage_for=lambda d: LocalStorage(os.fspath(d)),
        tier_runtime=lambda *a: pytest.fail("no memory tier in this save"),
    )


def _run(services: SaveServices, tmp_path: Any, tag: str, **kw: Any) -> tuple[SaveOutcome, SaveReport]:
    options = save_options(tmp_path, tag, model={"w": torch.ones(4)}, **kw)
    report = SaveReport(tag=tag, checkpoint_dir=str(tmp_path), async_save=options.async_save)
    return SavePipeline(services).run(options, report), report


def test_run_hands_back_the_sequence_number_and_its_jobs(tmp_path):
    services = _services(tmp_path, seq=7)
    outcome, report = _run(services, tmp_path, "sync", num_kept_ckpts=2)
    assert (outcome.seq, outcome.job, outcome.error) == (7, None, None) and report.completed
    assert isinstance(outcome.retention, Future)
    outcome, report = _run(services, tmp_path, "async", async_save=True)
    assert outcome.seq == 7 and outcome.retention is None and isinstance(outcome.job, Future)
    assert outcome.job.result() is None and report.wait().completed  # nothing failed: nothing to report
    services.writer.close()
    assert report.blocked_s > 0 and report.total_s >= report.blocked_s


def test_a_failed_save_hands_back_its_error_or_records_it(tmp_path):
    def no_topology() -> Topology:
        raise RuntimeError("no parallel state")

    services = _services(tmp_path, seq=3, topology=no_topology)
    outcome, report = _run(services, tmp_path, "t", on_save_error="raise")
    assert outcome.seq is None and isinstance(outcome.error, RuntimeError)  # failed before begin agreed on it
    outcome, report = _run(services, tmp_path, "t", on_save_error="warn")
    assert outcome.seq is None and outcome.error is None and "no parallel state" in (report.error or "")


def test_an_async_failure_under_warn_is_the_jobs_result(tmp_path):
    class Unpicklable:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("cannot pickle this")

    services = _services(tmp_path, seq=1)
    outcome, report = _run(
        services, tmp_path, "bad", async_save=True, on_save_error="warn", user_content={"x": Unpicklable()}
    )
    assert outcome.error is None and outcome.job is not None
    failure = outcome.job.result()  # the manager puts it into the next SaveReport's earlier_failures
    services.writer.close()
    assert failure is not None and failure.startswith("bad: ") and "cannot pickle this" in failure
    assert report.error is not None and not (tmp_path / "bad" / "done").exists()


class _CountingModel(torch.nn.Module):
    """A model that counts the calls of its ``state_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.state_dict_calls = 0

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.state_dict_calls += 1
        return super().state_dict(*args, **kwargs)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_builds_the_models_state_dict_once(tmp_path, async_save):
    """The manager builds it (refusing meta tensors before any collective) and the pipeline writes that one."""
    manager = CheckpointManager(topology=Topology(rank=0))
    model = _CountingModel()
    manager.save(tmp_path, "t", model=model, async_save=async_save).wait()
    manager.finalize()
    assert model.state_dict_calls == 1 and (tmp_path / "t" / "done").exists()


def test_a_model_without_data_is_refused_before_the_save_begins(tmp_path, monkeypatch):
    """Meta tensors fail the save in the manager, under any ``on_save_error``: no collective, no file."""
    events: dict[int, list[str]] = {0: []}
    _note_steps(monkeypatch, events, write=False)
    manager = CheckpointManager(topology=Topology(rank=0))
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="meta"):
        manager.save(tmp_path, "t", model=model, on_save_error="warn")
    assert events[0] == [] and not (tmp_path / "t").exists()
