"""The host<->device layer's policies, in one process without an accelerator: the snapshot budget, the split of a
state by it, the pinned buffer pool, and the background transfer's order, errors and release of its sources.
(XLA: tests/xla/test_xla_device_snapshot.py; CUDA: tests/cuda/, on a GPU machine.)"""

from __future__ import annotations

import threading

import pytest
import torch

from nxd_ckpt.device import backend
from nxd_ckpt.device.pinned import PinnedPool
from nxd_ckpt.device.snapshot import split_by_budget
from nxd_ckpt.device.transfer import DeviceTransfer, stand_in


def _t(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_split_by_budget_keeps_the_order_and_lets_later_smaller_tensors_fit():
    tensors = [_t(40), _t(50), _t(30), _t(10)]
    assert split_by_budget(tensors, 80) == ([0, 2, 3], [1])
    assert split_by_budget(tensors, 0) == ([], [0, 1, 2, 3])
    assert split_by_budget(tensors, 10**9) == ([0, 1, 2, 3], [])


def test_the_budget_setting(monkeypatch):
    monkeypatch.delenv(backend.BUDGET_ENV, raising=False)
    assert backend.resolve_snapshot_budget(None) == backend.SnapshotBudget(None)
    assert backend.resolve_snapshot_budget("auto") == backend.SnapshotBudget(None)
    assert backend.resolve_snapshot_budget("2GiB").bytes == 2 << 30
    assert backend.resolve_snapshot_budget(0).bytes == 0
    monkeypatch.setenv(backend.BUDGET_ENV, "512MiB")
    assert backend.resolve_snapshot_budget(None).bytes == 512 << 20
    assert backend.resolve_snapshot_budget(1024).bytes == 1024  # the keyword wins over the variable
    monkeypatch.setenv(backend.BUDGET_ENV, "0")
    assert backend.resolve_snapshot_budget(None).bytes == 0
    monkeypatch.setenv(backend.BUDGET_ENV, "plenty")
    with pytest.raises(ValueError, match="NXD_CKPT_DEVICE_SNAPSHOT_BUDGET='plenty' is not a size"):
        backend.resolve_snapshot_budget(None)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="device_snapshot_budget must be"):
            backend.resolve_snapshot_budget(bad)


def test_a_fixed_budget_is_used_as_is_and_without_a_peak_memory_figure_auto_copies_nothing_on_the_device():
    tensors = [torch.empty(1000, device="meta"), torch.empty(3000, device="meta")]
    assert backend.SnapshotBudget(123).resolve(tensors) == (123, "set")
    assert backend.SnapshotBudget(None).resolve(tensors) == (0, backend.SOURCE_NONE)


def _fake_xla_runtime(monkeypatch, host_memory: bool, memory_info) -> list[str]:
    """torch_xla as the budget sees it: loaded, on the CPU client or not, with ``memory_info`` as
    ``xm.get_memory_info``; returns the devices it was asked about."""
    import sys
    import types

    asked: list[str] = []

    def get_memory_info(device):
        asked.append(str(device))
        return memory_info()

    root, core, xm = (types.ModuleType(n) for n in ("torch_xla", "torch_xla.core", "torch_xla.core.xla_model"))
    xm.get_memory_info = get_memory_info  # type: ignore[attr-defined]
    root.core, core.xla_model = core, xm  # type: ignore[attr-defined]
    for module in (root, core, xm):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(backend.xla, "loaded", lambda: root)
    monkeypatch.setattr(backend, "_xla_device_is_host_memory", lambda: host_memory)
    monkeypatch.setattr(backend, "_NO_MEMORY_INFO", set())
    return asked


def test_the_xla_cpu_client_is_not_asked_for_memory_and_a_runtime_that_refuses_is_asked_once(monkeypatch):
    def refuse():
        raise RuntimeError("Bad StatusOr access: UNIMPLEMENTED: GetAllocatorStats is not supported")

    asked = _fake_xla_runtime(monkeypatch, host_memory=True, memory_info=refuse)
    assert backend.xla_peak_headroom_bytes(torch.device("xla:0")) is None and asked == []  # its refusal: 25 ms
    asked = _fake_xla_runtime(monkeypatch, host_memory=False, memory_info=refuse)
    assert [backend.xla_peak_headroom_bytes(torch.device("xla:0")) for _ in range(3)] == [None] * 3
    assert asked == ["xla:0"]


def test_a_runtime_with_memory_figures_is_asked_each_time_and_only_its_peak_counts(monkeypatch):
    answers = iter(
        [
            RuntimeError("device busy"),  # a passing failure: asked again
            {"bytes_limit": 1000, "bytes_used": 400, "peak_bytes_used": 700},
            {"bytes_limit": 1000, "bytes_used": 400},  # a single moment's figure: not a size for the snapshot
        ]
    )

    def answer():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    asked = _fake_xla_runtime(monkeypatch, host_memory=False, memory_info=answer)
    assert [backend.xla_peak_headroom_bytes(torch.device("xla:0")) for _ in range(3)] == [None, 300, None]
    assert len(asked) == 3


def test_device_kinds():
    assert backend.kind(torch.ones(1)) == "cpu" and backend.kind(torch.empty(1, device="meta")) == "meta"
    assert not backend.on_device(torch.ones(1)) and not backend.on_device(torch.empty(1, device="meta"))
    assert backend.native_device([torch.ones(1)]) is None
    with pytest.raises(ValueError, match="has no streams and events"):
        backend.NativeDevice(torch.device("meta"))


def test_pinned_pool_reuses_by_shape_and_dtype_and_drops_buffers_lent_before_a_clear():
    made: list[torch.Tensor] = []

    def allocate(shape, dtype):
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    pool = PinnedPool()
    a = pool.take(torch.empty(4, 4), allocate)
    pool.give_back([a])
    assert pool.take(torch.empty(4, 4), allocate) is a and len(made) == 1
    assert pool.take(torch.empty(4, 4, dtype=torch.float16), allocate) is not a and len(made) == 2
    assert pool.reserve([torch.empty(4, 4), torch.empty(4, 4), torch.empty(8)], allocate) == 2 * 64 + 32
    assert pool.held_bytes == 2 * 64 + 32 and pool.reserve([torch.empty(8)], allocate) == 0
    generation = pool.generation
    lent = pool.take(torch.empty(8), allocate)
    pool.clear()
    pool.give_back([lent], generation)  # came back after finalize: not kept
    assert pool.held_bytes == 0 and pool.allocated_bytes == sum(t.numel() * t.element_size() for t in made)


def _sources(n: int) -> list[torch.Tensor]:
    return [torch.full((256,), float(i)) for i in range(n)]


def test_the_transfer_serves_keys_in_any_order_and_drops_each_chunk_of_sources_once_it_arrived():
    sources = _sources(6)
    keys = [stand_in(s) for s in sources]
    transfer = DeviceTransfer(keys, list(sources), chunk_bytes=2 * 256 * 4)
    for i in reversed(range(6)):
        assert torch.equal(transfer.host(keys[i]), sources[i])
    assert transfer.device_bytes_held == 0 and all(s is None for s in transfer._sources)
    other = stand_in(torch.ones(2))
    assert transfer.host(other) is not None and transfer.host(other).device.type == "meta"  # not planned: itself
    transfer.close()


def test_a_transfer_error_reaches_the_waiting_writer_once_else_close(monkeypatch):
    calls: list[int] = []
    real = DeviceTransfer._copy_chunk

    def second_chunk_fails(transfer, chunk):
        calls.append(len(chunk))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(transfer, chunk)

    monkeypatch.setattr(DeviceTransfer, "_copy_chunk", second_chunk_fails)
    sources = _sources(4)
    keys = [stand_in(s) for s in sources]
    transfer = DeviceTransfer(keys, list(sources), chunk_bytes=2 * 256 * 4)
    assert torch.equal(transfer.host(keys[0]), sources[0])
    with pytest.raises(RuntimeError, match="device lost"):
        transfer.host(keys[3])
    transfer.close()  # a writer saw it: not raised twice
    calls.clear()
    transfer = DeviceTransfer(keys, list(sources), chunk_bytes=2 * 256 * 4)
    with pytest.raises(RuntimeError, match="device lost"):
        transfer.close()  # nobody saw it: close raises it


def test_the_transfer_runs_on_its_own_thread_or_on_the_callers(monkeypatch):
    threads: list[str] = []
    real = DeviceTransfer._copy_chunk

    def recording(transfer, chunk):
        threads.append(threading.current_thread().name)
        return real(transfer, chunk)

    monkeypatch.setattr(DeviceTransfer, "_copy_chunk", recording)
    sources = _sources(2)
    DeviceTransfer([stand_in(s) for s in sources], list(sources)).close()
    assert threads == ["nxd_ckpt_d2h"]
    threads.clear()
    DeviceTransfer([stand_in(s) for s in sources], list(sources), background=False).close()
    assert threads == [threading.current_thread().name]


def _transfer_and_exit() -> None:
    sources = _sources(2)
    keys = [stand_in(s) for s in sources]
    transfer = DeviceTransfer(keys, list(sources))
    ok = all(torch.equal(transfer.host(k), s) for k, s in zip(keys, sources, strict=True))
    transfer.close()
    raise SystemExit(0 if ok else 3)


def test_transfers_share_one_thread_that_a_save_starts_before_its_snapshot_and_a_forked_child_gets_its_own():
    import multiprocessing

    from nxd_ckpt.device.transfer import THREAD_NAME, start_transfer_thread

    start_transfer_thread()
    before = {t.ident for t in threading.enumerate() if t.name == THREAD_NAME}
    assert len(before) == 1
    ran_on: set[int | None] = set()
    real = DeviceTransfer._copy_chunk

    def recording(transfer, chunk):
        ran_on.add(threading.get_ident())
        return real(transfer, chunk)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeviceTransfer, "_copy_chunk", recording)
        for _ in range(3):
            sources = _sources(2)
            DeviceTransfer([stand_in(s) for s in sources], list(sources)).close()
    assert ran_on == before  # no thread started per transfer
    assert {t.ident for t in threading.enumerate() if t.name == THREAD_NAME} == before
    child = multiprocessing.get_context("fork").Process(target=_transfer_and_exit)
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, f"a transfer in a forked child ended with {child.exitcode} (None: it hung)"
