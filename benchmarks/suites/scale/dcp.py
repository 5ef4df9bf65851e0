"""The scale suite's DCP rows: what the coordinator of a ``nxd_ckpt.dcp`` save and of its load's planning does at N
simulated ranks (``--sections dcp``).

Every rank's part runs in this process, one after another, through the real code: DCP's ``DefaultSavePlanner``
(local plans, the global plan and ``.metadata``), one ``StorageWriter`` per rank writing its file and returning its
``WriteResult``s (its file records among them), the coordinator's ``finish`` on all of them (what DCP's gather hands
it), then the load's ``read_metadata`` and ``prepare_global_plan`` over every rank's ``DefaultLoadPlanner`` plan. The
coordinator's storage is seen through ``testing.counting.RequestCountingStorage``. Reported per world size: the
coordinator's wall time in ``finish`` and in the load's planning (its coordination: the ranks' own work is not
counted), its storage requests in ``finish`` and in preparing the save (``prepare_global_plan``: the staging
folder), the same at every size, the bytes each rank sends in DCP's gather of the results,
and the size of the combined index.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from nxd_ckpt.dcp import StorageReader, StorageWriter
from nxd_ckpt.format import layout
from nxd_ckpt.storage import LocalStorage
from nxd_ckpt.testing.counting import RequestCountingStorage


def _counted(obj: Any, counting: RequestCountingStorage) -> None:
    """Route a writer's or reader's storage through ``counting``."""
    obj.place = dataclasses.replace(obj.place, root=counting)


def dcp_rows(n: int, root: str) -> list[dict[str, Any]]:
    """A DCP save's commit and its load's planning at ``n`` ranks, in a folder under ``root``."""
    base = os.path.join(root, f"dcp_{n}")
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, "step-1")
    counting = RequestCountingStorage(LocalStorage(base))
    writers = [StorageWriter(path) for _ in range(n)]
    coordinator = writers[0]
    _counted(coordinator, counting)
    planners = [DefaultSavePlanner() for _ in range(n)]
    local = []
    for rank, (writer, planner) in enumerate(zip(writers, planners, strict=True)):
        planner.set_up_planner({f"rank{rank}": torch.full((16,), float(rank))}, coordinator.storage_meta(), rank == 0)
        writer.set_up_storage_writer(rank == 0)
        local.append(writer.prepare_local_plan(planner.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(local)
    counting.reset()
    plans = coordinator.prepare_global_plan(plans)
    prepare_requests = dict(counting.requests)
    results = []
    for rank, (writer, planner, plan) in enumerate(zip(writers, planners, plans, strict=True)):
        # each rank on its own: no c10d store here, so no check-in (the world of each writer is itself), and the
        # save's facts (its id, its memory-tier decision) reach the other ranks' writers as the store would carry them
        plan = dataclasses.replace(plan, storage_data=dataclasses.replace(plan.storage_data, world_size=1))
        writer._facts = coordinator._facts
        results.append(writer.write_data(planner.finish_plan(plan), planner).value())
        del rank
    gathered = [len(pickle.dumps(r)) for r in results]
    counting.reset()
    start = time.perf_counter()
    coordinator.finish(metadata, results)
    commit_s = time.perf_counter() - start
    save_requests = dict(counting.requests)
    index_bytes = os.path.getsize(os.path.join(base, layout.dcp_index_file("step-1")))

    reader = StorageReader(path)
    _counted(reader, counting)
    counting.reset()
    start = time.perf_counter()
    read = reader.read_metadata()
    reader.set_up_storage_reader(read, True)
    planning_s = time.perf_counter() - start
    load_plans = []
    for rank in range(n):
        planner = DefaultLoadPlanner()
        planner.set_up_planner({f"rank{rank}": torch.zeros(16)}, read, rank == 0)
        load_plans.append(planner.create_local_plan())
    start = time.perf_counter()
    reader.prepare_global_plan(load_plans)
    planning_s += time.perf_counter() - start
    load_requests = dict(counting.requests)
    return [
        {"op": "dcp save", "ranks": n, "coordinator_s": commit_s, "requests": save_requests,
         "prepare_requests": prepare_requests, "gather_bytes_per_rank": max(gathered), "index_bytes": index_bytes},
        {"op": "dcp load planning", "ranks": n, "coordinator_s": planning_s, "requests": load_requests},
    ]  # fmt: skip


def print_dcp(row: dict[str, Any]) -> None:
    """One DCP row, as it is measured."""
    requests = " ".join(f"{k}={v}" for k, v in sorted(row["requests"].items()))
    extra = ""
    if "index_bytes" in row:
        prepare = sum(row["prepare_requests"].values())
        extra = f", gather {row['gather_bytes_per_rank']} B/rank, index {row['index_bytes']} B, {prepare} to prepare"
    print(
        f"{row['op']:<18} {row['ranks']:>6} ranks: coordinator {row['coordinator_s']:.3f} s, "
        f"requests {sum(row['requests'].values())} ({requests}){extra}",
        flush=True,
    )
