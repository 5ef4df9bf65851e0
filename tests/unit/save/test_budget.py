"""An async save under a host memory budget holds at most the budget (+64 MiB) above the memory in use
before it, stages and writes a larger state in pieces while the call waits, and the tag loads bit-exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from harness.residency import MincoreUnavailable, resident_fraction
from nxd_ckpt.device.pinned import PinnedArena
from nxd_ckpt.options import resolve_budget
from nxd_ckpt.save import budget as save_budget
from nxd_ckpt.save.budget import BudgetedStager

MIB = 1 << 20

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import nxd_ckpt as nxd

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    ckpt, encoding, budget = sys.argv[1], sys.argv[2], sys.argv[3]
    budget = None if budget == "none" else int(budget)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.rand(2048, 2048, generator=gen) for i in range(4)}  # 64 MiB
    optimizer = {
        "state": {i: {"exp_avg": torch.rand(2048, 2048, generator=gen), "exp_avg_sq": torch.rand(2048, 2048,
                  generator=gen)} for i in range(4)},
        "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3]}],
    }  # 128 MiB
    state = sum(t.numel() * t.element_size() for t in model.values()) + 128 * 2**20
    xser = encoding == "xser"
    expected = {k: v.clone() for k, v in model.items()}
    tiny = {"w": torch.ones(4)}
    nxd.save_checkpoint(ckpt, "warmup", model=tiny, async_save=True, use_xser=xser).wait()  # imports, threads
    import gc; gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
    base = rss("VmRSS:")
    report = nxd.save_checkpoint(ckpt, "t", model=model, optimizer=optimizer, async_save=True, use_xser=xser,
                                 host_memory_budget=budget)
    for t in model.values():  # training goes on: the checkpoint must hold the values at the call
        t.add_(1.0)
    report.wait()
    extra = rss("VmHWM:") - base
    nxd.finalize_checkpoint()
    m, o = {}, {}
    nxd.load_checkpoint(ckpt, "t", model=m, optimizer=o)
    exact = all(torch.equal(expected[k], m[k]) for k in model) and all(
        torch.equal(optimizer["state"][i][k], o["state"][i][k]) for i in range(4) for k in ("exp_avg", "exp_avg_sq"))
    print(json.dumps({"extra": extra, "state": state, "exact": exact, "waited": report.budget_wait_s,
                      "blocked": report.blocked_s}))
    """
)


def _run(ckpt: str, encoding: str, budget: int | None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, ckpt, encoding, str(budget) if budget else "none"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
@pytest.mark.parametrize("encoding", ["plain", "xser"])
def test_a_quarter_of_the_state_as_budget_bounds_peak_memory_and_the_tag_loads_bit_exactly(tmp_path, encoding):
    """Fresh processes (peak RSS, not timed): without a budget the async save holds a copy of the state (the
    control); with a quarter of the state as budget it holds at most the budget + 64 MiB, and the checkpoint
    holds the values at the call although training changed them right after."""
    unbounded = _run(str(tmp_path / "free"), encoding, None)
    assert unbounded["exact"]
    assert unbounded["extra"] >= 0.9 * unbounded["state"], unbounded  # the measure sees a staged copy
    budget = unbounded["state"] // 4
    bounded = _run(str(tmp_path / "budget"), encoding, budget)
    assert bounded["exact"], bounded
    assert bounded["extra"] <= budget + 64 * MIB, (bounded, budget)
    assert bounded["waited"] > 0.0  # the call waited for what did not fit, and says so


def test_budget_values_are_checked_and_sizes_parsed(monkeypatch):
    monkeypatch.delenv("NXD_CKPT_HOST_MEMORY_BUDGET", raising=False)
    assert resolve_budget(None) is None
    assert resolve_budget("512MiB") == 512 * MIB
    assert resolve_budget(4096) == 4096
    monkeypatch.setenv("NXD_CKPT_HOST_MEMORY_BUDGET", "2GiB")
    assert resolve_budget(None) == 2 << 30
    for bad in ("lots", 0, -1, True, 1.5):
        with pytest.raises(ValueError, match="host_memory_budget"):
            resolve_budget(bad)  # type: ignore[arg-type]


def _writer(stager: BudgetedStager, order: list[torch.Tensor], out: list, files: list[list[int]]) -> None:
    """Writes ``files`` (lists of tensor indices) one by one: fetch each tensor, read it, close the file."""
    for indices in files:
        out.append([stager.host(order[i]).clone() for i in indices])
        stager.file_written()
    stager.close()


def test_the_stager_never_holds_more_than_the_budget_and_waits_for_live_reads():
    order = [torch.full((MIB // 4,), float(i)) for i in range(8)]  # 1 MiB each
    stager = BudgetedStager(order, budget=3 * MIB + 1, timeout_s=60)
    out: list = []
    writer = threading.Thread(target=_writer, args=(stager, order, out, [[0, 1], [2], [3, 4, 5], [6, 7]]))
    writer.start()
    stager.stage()
    for t in order:  # training resumes: nothing written afterwards may see these values
        t.add_(100.0)
    writer.join(timeout=60)
    assert [[float(t[0]) for t in f] for f in out] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0], [6.0, 7.0]]
    assert stager.peak_bytes <= 3 * MIB + 1
    assert stager.staged_bytes + stager.borrowed_bytes >= 8 * MIB


def test_a_tensor_larger_than_the_budget_is_written_live_before_the_call_returns():
    big = torch.arange(4 * MIB // 4, dtype=torch.float32)
    stager = BudgetedStager([big], budget=MIB, timeout_s=60)
    seen: list = []

    def writer() -> None:
        seen.append(stager.host(big).data_ptr() == big.data_ptr())
        seen.append(float(stager.host(big)[-1]))
        stager.file_written()
        stager.close()

    thread = threading.Thread(target=writer)
    thread.start()
    stager.stage()  # returns only after the writer closed the file that read the live tensor
    assert seen == [True, float(4 * MIB // 4 - 1)]
    assert stager.peak_bytes == 0 and stager.borrowed_bytes == 4 * MIB
    thread.join(timeout=60)


def _frozen(order: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Copies of ``order`` that nothing changes, as a device snapshot's are (keyed by the live tensor)."""
    return {id(t): t.clone() for t in order}


def test_frozen_tensors_are_staged_beside_training_within_the_budget_and_the_call_does_not_wait_for_them():
    order = [torch.full((MIB // 4,), float(i)) for i in range(8)]  # 1 MiB each
    live = torch.full((MIB // 4,), 8.0)  # one live tensor: the call waits for it alone
    fetched: list[int] = []

    def fetch(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        fetched.append(len(sources))
        return [t.clone() for t in sources]

    everything = [*order, live]
    stager = BudgetedStager(
        everything, budget=3 * MIB, timeout_s=60, frozen=_frozen(order), fetch=fetch, batch_bytes=2 * MIB
    )
    stager.stage()  # only the live tensor: copied, nothing waited for
    assert stager.staged_bytes == MIB and stager.waited_s < 1.0
    for t in everything:  # training resumes
        t.add_(100.0)
    beside = threading.Thread(target=stager.stage_frozen)
    beside.start()
    out: list = []
    _writer(stager, everything, out, [[0, 1], [2], [3, 4, 5], [6, 7], [8]])
    beside.join(timeout=60)
    assert [[float(t[0]) for t in f] for f in out] == [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0], [6.0, 7.0], [8.0]]
    assert stager.peak_bytes <= 3 * MIB + stager.overdrawn_bytes
    assert max(fetched) <= 2, "a batch is at most batch_bytes"
    assert not stager._frozen, "every device copy is dropped once on the host"


def test_a_writer_ahead_of_the_frozen_copies_copies_what_it_needs_itself():
    order = [torch.full((MIB // 4,), float(i)) for i in range(3)]
    stager = BudgetedStager(order, budget=MIB, timeout_s=60, frozen=_frozen(order))
    for t in order:
        t.add_(100.0)
    out: list = []
    _writer(stager, order, out, [[0, 1, 2]])  # stage_frozen never ran: all three in one file, over the budget
    assert [float(t[0]) for t in out[0]] == [0.0, 1.0, 2.0]
    assert stager.overdrawn_bytes == 2 * MIB


def test_writers_of_one_tensor_files_wait_for_the_frozen_copies_instead_of_overdrawing(monkeypatch):
    """xser writes a file per tensor, on several threads: they wait for ``stage_frozen``, whose copies never hold
    more than the budget."""
    monkeypatch.setattr(save_budget, "STUCK_S", 60.0)  # a copier held up by a loaded machine is waited for
    order = [torch.full((MIB // 4,), float(i)) for i in range(12)]
    stager = BudgetedStager(order, budget=2 * MIB, timeout_s=60, frozen=_frozen(order), batch_bytes=MIB)
    stager.begin_frozen()
    for t in order:
        t.add_(100.0)
    files = iter(range(12))
    claim = threading.Lock()
    out: dict[int, float] = {}

    def writer() -> None:
        while True:
            with claim:
                i = next(files, None)
            if i is None:
                return
            out[i] = float(stager.host(order[i])[0])
            stager.file_written()

    writers = [threading.Thread(target=writer) for _ in range(4)]
    for w in writers:
        w.start()
    stager.stage_frozen()
    for w in writers:
        w.join(timeout=60)
    stager.close()
    assert out == {i: float(i) for i in range(12)}
    assert stager.overdrawn_bytes == 0 and stager.peak_bytes <= 2 * MIB


def test_frozen_copies_wait_for_a_free_run_of_the_pinned_arena_where_the_budget_has_room(monkeypatch):
    """Files written out of order split the arena's free space: the next copy waits until a run holds it, as it
    waits for the budget, instead of missing the arena (pageable memory)."""
    monkeypatch.setattr(save_budget, "STUCK_S", 60.0)  # the writer always waits for the copier, however slow it starts
    unit = 64 << 10
    order = [torch.full((n * unit // 4,), float(i)) for i, n in enumerate((1, 1, 1, 2))]
    arena = PinnedArena(3 * unit, lambda shape, dtype: torch.empty(shape, dtype=dtype))

    last_fetched = threading.Event()

    def fetch(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        pieces = [arena.take(t) for t in sources]
        if any(t.numel() == order[3].numel() for t in sources):
            last_fetched.set()
        return [p.copy_(t) if p is not None else t.clone() for p, t in zip(pieces, sources, strict=True)]

    stager = BudgetedStager(
        order, budget=3 * unit, timeout_s=60, frozen=_frozen(order), fetch=fetch, batch_bytes=unit,
        give_back=arena.give_back, room=arena.placeable,
    )  # fmt: skip
    stager.begin_frozen()
    beside = threading.Thread(target=stager.stage_frozen)
    beside.start()
    deadline = time.monotonic() + 60
    while stager.staged_bytes < 3 * unit:  # 0, 1, 2 fill the arena, in this order
        assert time.monotonic() < deadline and beside.is_alive(), "the copier did not stage 0, 1 and 2"
        time.sleep(0.01)
    out = []
    for i in (0, 2):  # then 0 and 2 are written: the budget has room for 3, the arena two runs of one unit each
        out.append(float(stager.host(order[i])[0]))
        stager.file_written()
    assert not last_fetched.wait(0.5), "3 was copied before a run of the arena held it"
    for i in (1, 3):
        out.append(float(stager.host(order[i])[0]))
        stager.file_written()
    stager.close()
    beside.join(timeout=60)
    assert out == [0.0, 2.0, 1.0, 3.0] and last_fetched.is_set()
    assert arena.refused_bytes == 0 and arena.lent_bytes == 0
    assert stager.copied_by_writers_bytes == 0 and stager.peak_bytes <= 3 * unit


def test_the_arena_carves_pieces_first_fit_merges_what_comes_back_and_tells_what_it_would_place():
    arena = PinnedArena(1024, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    assert arena.allocated_bytes == 0 and arena.placeable([1024, 1]) == 1  # pinned on the first take only
    a, b, c, _ = (arena.take(torch.empty(n, dtype=torch.uint8)) for n in (256, 10, 256, 256))
    assert arena.allocated_bytes == 1024 and arena.lent_bytes == 1024  # 10 bytes take one aligned unit of 256
    assert [p.data_ptr() - a.data_ptr() for p in (a, b, c)] == [0, 256, 512]
    assert arena.take(torch.empty(1, dtype=torch.uint8)) is None and arena.refused_bytes == 1
    arena.give_back(a)
    arena.give_back(c)
    assert arena.placeable([512]) == 0  # 512 bytes free, in two runs
    assert arena.placeable([256, 256, 256]) == 2 and arena.placeable([2048, 256]) == 2  # larger than all: no wait
    arena.give_back(b)
    assert arena.placeable([768]) == 1 and arena.placeable([769]) == 0 and arena.lent_bytes == 256
    d = arena.take(torch.empty(2, 96, dtype=torch.float32))  # 768 bytes, where a and b were
    assert d is not None and d.shape == (2, 96) and d.dtype == torch.float32 and d.data_ptr() == a.data_ptr()


def test_a_file_larger_than_the_budget_overdraws_it_rather_than_stall():
    """A plain file holds its tensors until it is closed: once the budget is full of them, its writer copies the
    next ones itself."""
    order = [torch.full((MIB // 4,), float(i)) for i in range(4)]
    stager = BudgetedStager(order, budget=2 * MIB, timeout_s=60, frozen=_frozen(order), batch_bytes=MIB)
    stager.begin_frozen()
    beside = threading.Thread(target=stager.stage_frozen)
    beside.start()
    out: list = []
    _writer(stager, order, out, [[0, 1, 2, 3]])
    beside.join(timeout=60)
    assert [float(t[0]) for t in out[0]] == [0.0, 1.0, 2.0, 3.0]
    assert stager.overdrawn_bytes == 2 * MIB


def test_a_writer_that_fails_releases_the_background_copier_waiting_for_room():
    """The writer takes two copies (the whole budget) and fails before closing its file: ``close`` (the write's
    end) frees the copier, which waited for room, instead of leaving the process's transfer thread stuck."""
    order = [torch.ones(MIB // 4) for _ in range(4)]
    stager = BudgetedStager(order, budget=2 * MIB, timeout_s=60, frozen=_frozen(order), batch_bytes=MIB)
    stager.begin_frozen()
    beside = threading.Thread(target=stager.stage_frozen)
    beside.start()
    stager.host(order[0])
    stager.host(order[1])  # the budget is full; the copier waits for room that never comes
    stager.close()
    beside.join(timeout=10)
    assert not beside.is_alive()


def test_a_writer_does_not_wait_forever_for_a_copier_that_never_starts(monkeypatch):
    monkeypatch.setattr(save_budget, "STUCK_S", 0.2)
    order = [torch.full((MIB // 4,), 7.0)]
    stager = BudgetedStager(order, budget=2 * MIB, timeout_s=60, frozen=_frozen(order))
    stager.begin_frozen()  # announced, but the transfer thread never gets to it
    assert float(stager.host(order[0])[0]) == 7.0
    assert stager.overdrawn_bytes == 0  # copied by the writer, within the budget


def test_an_error_while_copying_frozen_tensors_reaches_the_writer():
    order = [torch.ones(MIB // 4) for _ in range(2)]

    def fetch(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        raise OSError("the device fell off the bus")

    stager = BudgetedStager(order, budget=4 * MIB, timeout_s=60, frozen=_frozen(order), fetch=fetch)
    stager.stage_frozen()
    with pytest.raises(RuntimeError, match="copying the state to the host failed: the device fell off the bus"):
        stager.host(order[0])


def test_a_stuck_writer_makes_the_call_fail_after_its_deadline_and_the_save_fail_too():
    from nxd_ckpt.errors import CheckpointTimeoutError

    order = [torch.ones(MIB // 4) for _ in range(3)]
    stager = BudgetedStager(order, budget=MIB + 1, timeout_s=0.3)
    with pytest.raises(CheckpointTimeoutError, match="host memory budget"):
        stager.stage()  # nobody writes: the second tensor never fits
    with pytest.raises(RuntimeError, match="abandoned"):
        stager.host(order[2])  # the writer that shows up late fails its save instead of reading live memory


def test_a_copy_goes_back_to_the_kernel_when_its_file_is_written_though_a_reference_lives_on():
    """The writer's frame may hold a copy for a while after its file is closed (under torch 2.9, long enough for
    the next copies to be made: budget + 33-65 MiB resident); the stager gives the copy's pages back at once."""
    order = [torch.full((2 * MIB // 4,), float(i)) for i in range(2)]  # 2 MiB each: copies in mappings of their own
    stager = BudgetedStager(order, budget=4 * MIB, timeout_s=60)
    stager.stage()  # both fit: staged before the writer asks
    copy = stager.host(order[0])
    assert copy.data_ptr() != order[0].data_ptr() and float(copy[-1]) == 0.0
    try:
        assert resident_fraction(copy) == 1.0
    except MincoreUnavailable as e:
        pytest.skip(str(e))
    stager.file_written()
    assert stager.held_bytes == 2 * MIB
    assert resident_fraction(copy) == 0.0  # still referenced here, no longer in memory
    second = stager.host(order[1])
    assert float(second[0]) == 1.0 and resident_fraction(second) == 1.0  # the other copy is untouched
    stager.file_written()
    stager.close()


def test_device_copies_waiting_for_room_give_up_at_the_deadline_and_the_writer_gets_the_error():
    """Nobody writes, so the second frozen tensor never finds room: ``stage_frozen`` stops waiting after the deadline
    (it does not hold the process's transfer thread for good) and a writer that then asks raises its error, naming
    the phase and the rank."""
    order = [torch.ones(MIB // 4) for _ in range(2)]
    stager = BudgetedStager(order, budget=MIB + 1, timeout_s=0.3, frozen=_frozen(order), rank=3)
    stager.begin_frozen()
    start = time.monotonic()
    stager.stage_frozen()
    assert time.monotonic() - start < 5
    assert torch.equal(stager.host(order[0]), order[0])  # it arrived before the wait
    with pytest.raises(RuntimeError, match="under the host memory budget on rank 3: waited 0.3 s"):
        stager.host(order[1])


def test_a_writer_waiting_for_a_copy_another_thread_makes_gives_up_at_the_deadline():
    from nxd_ckpt.errors import CheckpointTimeoutError

    order = [torch.ones(MIB // 4)]
    release = threading.Event()

    def stuck_fetch(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        release.wait(30)  # a device fetch that does not come back
        return [s.clone() for s in sources]

    stager = BudgetedStager(order, budget=4 * MIB, timeout_s=0.3, frozen=_frozen(order), fetch=stuck_fetch, rank=1)
    stager.begin_frozen()
    beside = threading.Thread(target=stager.stage_frozen)
    beside.start()
    try:
        while stager.held_bytes == 0:  # the copy is under way
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(CheckpointTimeoutError, match="on rank 1") as raised:
            stager.host(order[0])
        assert time.monotonic() - start < 5 and raised.value.phase == save_budget.FROZEN_PHASE
    finally:
        release.set()
        beside.join(timeout=30)
