"""Store operations per rank per save are bounded by a constant: they do not grow with how long a rank waits for
a late one (blocking waits on a connection of its own, not polls), nor with the number of ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from nxd_ckpt.manager import CheckpointManager
from nxd_ckpt.ranks.topology import Topology
from nxd_ckpt.testing.threadworld import ThreadWorld

pytestmark = pytest.mark.device_independent  # the store's operations: runs once, in the CPU lane

LATE_RANK = 3


def _save_ops(tmp_path, world: ThreadWorld, managers: list, tag: str, late_s: float, async_save: bool) -> list[int]:
    """Store operations each rank made during one save (``LATE_RANK`` starts it ``late_s`` late)."""
    before = [t.total() for t in world.tallies]

    def save(rank: int) -> None:
        if rank == LATE_RANK:
            time.sleep(late_s)
        managers[rank].save(tmp_path, tag, model={"w": torch.ones(4) * rank}, async_save=async_save)
        managers[rank].finalize()

    world.run(save)
    return [t.total() - b for t, b in zip(world.tallies, before, strict=True)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_store_ops_per_rank_do_not_grow_with_the_wait(tmp_path, async_save):
    world = ThreadWorld(4, count=True)
    managers = [
        CheckpointManager(coordinator=world.coordinator(r), topology=Topology(rank=r, tp_size=4)) for r in range(4)
    ]
    _save_ops(tmp_path, world, managers, "warm", 0.0, async_save)  # sessions, first keys
    short = _save_ops(tmp_path, world, managers, "s1", 0.2, async_save)
    long = _save_ops(tmp_path, world, managers, "s2", 2.5, async_save)
    # equal but for who arrives last at a step (that rank marks its group complete, counts it in and sets the key
    # the others wait for: two operations more than the others, at each step where it differs)
    assert all(abs(a - b) <= 4 for a, b in zip(long, short, strict=True)), (
        f"per rank: {short} at 0.2 s late, {long} at 2.5 s"
    )
    assert max(long) <= 40, long  # a handful per step (polling every 10 ms made ~250 per waiting rank here)
    waits = [t.snapshot().get(("waiting", "wait"), 0) for t in world.tallies]
    assert all(n > 0 for n in waits)  # the waits are blocking waits on the rank's own connection


def test_store_ops_per_rank_do_not_grow_with_the_ranks(tmp_path):
    def per_rank(n: int) -> list[int]:
        world = ThreadWorld(n, count=True)
        managers = [
            CheckpointManager(coordinator=world.coordinator(r), topology=Topology(rank=r, tp_size=n)) for r in range(n)
        ]
        _save_ops(tmp_path / str(n), world, managers, "warm", 0.0, False)
        return _save_ops(tmp_path / str(n), world, managers, "s1", 0.0, False)

    small, large = per_rank(2), per_rank(16)
    # Equal but for who arrives last at a step (a few operations more, as in the test above: which rank that is
    # depends on thread scheduling; a clean-clone CI run under load saw the master at 32 against 29). Growth with
    # the ranks would add at least one operation per extra rank: 14 here.
    assert max(large) <= max(small) + 4, (small, large)


def test_write_waves_wait_only_for_the_ranks_of_their_node():
    """num_workers bounds the writers of each node: between waves a node waits for its own ranks, not for the
    slowest rank of the job (4 ranks, 2 per node, one writer per node at a time; rank 0 is slow)."""
    world = ThreadWorld(4)
    started: dict[int, float] = {}

    def rank_main(rank: int) -> None:
        coord = world.coordinator(rank)

        def work() -> None:
            started[rank] = time.monotonic()
            if rank == 0:
                time.sleep(1.5)

        coord.in_waves(1, local_rank=rank % 2, local_world_size=2, fn=work, what="writing")

    world.run(rank_main)
    assert started[3] - started[2] < 1.0  # node 1's second wave did not wait for rank 0 (node 0)
    assert started[1] - started[0] >= 1.5  # node 0's second wave waited for its first


def test_missing_ranks_are_found_by_bisection_in_few_operations():
    from nxd_ckpt.ranks.arrivals import arrive, missing_ranks
    from nxd_ckpt.ranks.coordinator import local_store
    from nxd_ckpt.testing.counting import CountingStore

    store = CountingStore(local_store(10.0))
    missing = {3, 1000, *range(3000, 3100)}
    for r in range(4096):
        if r not in missing:
            arrive(store._store, "p", r, 4096)  # the arrivals themselves are not what is counted
    for r in range(1000):
        if r not in missing:
            arrive(store._store, "q", r, 1000)
    assert missing_ranks(store, "p", 4096) == sorted(missing)
    before = store.tally.total()
    assert missing_ranks(store, "p", 4096, limit=16) == sorted(missing)[:16]
    # a log line: 4 incomplete groups of 128 by bisection, then their bits: bounded, not 4,096 checks
    assert store.tally.total() - before <= 4 * 2 * 7 + 4
    before = store.tally.total()
    assert missing_ranks(store, "q", 1000) == [3]
    assert store.tally.total() - before <= 2 * 5 + 2  # one missing rank of 1,000: about 2·log2(N/32) + 1


def test_a_rank_arrives_with_one_store_operation_and_only_the_last_of_a_group_touches_shared_keys():
    """Arrival groups: 64 ranks make 64 + 2·2 + 1 operations in all (a bit each; per group the completion mark
    and the shared count; the last group sets 'all'), and the last rank of the world sets 'all'."""
    from nxd_ckpt.ranks.arrivals import all_arrived_key, arrive
    from nxd_ckpt.ranks.coordinator import local_store
    from nxd_ckpt.testing.counting import CountingStore

    store = CountingStore(local_store(10.0))
    for r in range(64):
        assert not arrive(store, "s", r, 64)
        assert store._store.check([all_arrived_key("s")]) == (r == 63)
    assert store.tally.total() == 64 + 2 * 2 + 1


def test_waves_without_check_make_no_world_wide_step_and_no_barrier_after_the_last_wave():
    """A save's write waves leave the failure check to its commit: no world-wide step, and the node waits only
    between waves (2 waves: one node barrier, not two); each rank raises only its own error."""
    world = ThreadWorld(4)
    steps: dict[int, tuple[int, int]] = {}

    def rank_main(rank: int) -> str:
        coord = world.coordinator(rank)

        def work() -> None:
            if rank == 3:
                raise ValueError("rank 3 failed")

        try:
            coord.in_waves(1, local_rank=rank % 2, local_world_size=2, fn=work, what="writing", check=False)
            outcome = "ok"
        except ValueError as e:
            outcome = str(e)
        steps[rank] = (coord._step, coord._node_steps)
        return outcome

    assert world.run(rank_main) == ["ok", "ok", "ok", "rank 3 failed"]
    assert steps == {r: (0, 1) for r in range(4)}


def test_a_save_takes_two_world_wide_steps_and_its_commit(tmp_path):
    """The start (every rank's layout, checked) and the master's preparation of the tag, which carries the
    sharding record's gather to rank 0: two store-gated steps before the commit (each releases every rank at
    the store, the cost that grows with the world), whatever the model."""
    world = ThreadWorld(4)
    coords = [world.coordinator(r) for r in range(4)]
    managers = [CheckpointManager(coordinator=coords[r], topology=Topology(rank=r, tp_size=4)) for r in range(4)]

    def steps_of_one_save(tag: str) -> list[int]:
        before = [c._step for c in coords]

        def save(rank: int) -> None:
            managers[rank].save(tmp_path, tag, model={"w": torch.ones(4) * rank}, async_save=False)

        world.run(save)
        return [c._step - b for c, b in zip(coords, before, strict=True)]

    try:
        steps_of_one_save("warm")
        assert steps_of_one_save("s1") == [2, 2, 2, 2]
    finally:
        world.close()


def test_gather_to_master_and_master_computes_is_one_step_and_only_rank_0_receives_the_list():
    world = ThreadWorld(3, count=True)
    try:

        def both(rank: int) -> tuple[Any, Any]:
            coord = world.coordinator(rank)
            gathered, value = coord.gather_to_master_and_master_computes(f"share {rank}", lambda: "prepared", "start")
            return gathered, value, coord._step

        results = world.run(both)
        assert results[0] == (["share 0", "share 1", "share 2"], "prepared", 1)
        assert results[1] == (None, "prepared", 1) and results[2] == (None, "prepared", 1)
        assert world.collectives[1]["gather"][1] == 0  # a rank other than 0 receives no one's share

        def failing(rank: int) -> str:
            def broken() -> str:
                raise OSError("rank 0 could not mark the tag")

            try:
                world.coordinator(rank).gather_to_master_and_master_computes(rank, broken, "start")
            except OSError as e:
                return str(e)
            return "no error"

        assert all("could not mark the tag" in m for m in world.run(failing))
    finally:
        world.close()


def test_an_agreement_over_the_gathered_shares_reaches_every_rank_in_the_same_step():
    world = ThreadWorld(3, count=True)
    try:

        def both(rank: int) -> tuple[Any, Any, int]:
            coord = world.coordinator(rank)
            proposal = [900, 300, 500][rank]
            gathered, value = coord.gather_to_master_and_master_computes(proposal, lambda: "prepared", "start", min)
            return gathered, value, coord._step

        results = world.run(both)
        assert results[0] == ([900, 300, 500], ("prepared", 300), 1)
        assert results[1] == (None, ("prepared", 300), 1) and results[2] == (None, ("prepared", 300), 1)
        assert world.collectives[1]["gather"][1] == 0  # still: a rank other than 0 receives no one's share
    finally:
        world.close()


def test_an_agreement_that_refuses_raises_everywhere_before_rank_0_computes():
    world = ThreadWorld(3, count=True)
    computed: list[int] = []
    try:

        def refuse(shares: list[int]) -> int:
            raise ValueError(f"the shares differ: {shares}")

        def step(rank: int) -> str:
            coord = world.coordinator(rank)
            try:
                coord.gather_to_master_and_master_computes(rank, lambda: computed.append(rank), "start", refuse)
            except ValueError as e:
                return str(e)
            return "no error"

        assert all("the shares differ: [0, 1, 2]" in m for m in world.run(step))
        assert computed == []  # rank 0's step (which may write to storage) never ran
    finally:
        world.close()
