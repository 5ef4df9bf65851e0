"""The library's threads and native accelerators, on the fake accelerator of ``harness.fake_accelerator`` (two
devices, a current device per thread, each call that needs a device context recorded): every thread works under the
device of the tensors it moves, ``DeviceCopies.fetch`` makes its side stream and waits for the clones once whatever
the threads that call it, and a child forked after a save does not inherit the registered staging buffers. Each test
runs in a spawned process, since a backend registered in Python cannot be removed."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch
import torch.utils.backend_registration as backend_registration

from harness.multiprocess import run_with_ranks

pytestmark = pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
    reason=f"torch {torch.__version__} cannot register a backend written in Python (torch >= 2.10 can)",
)

WIDTH = 256
"""The model's largest tensors are 1 MiB: staging buffers that size are registered (``REGISTER_MIN_BYTES``)."""


def _fake():
    from harness import fake_accelerator

    fake_accelerator.install()
    return fake_accelerator


@run_with_ranks(1)
def test_every_thread_works_under_the_device_of_the_state_it_moves(tmp_path):
    """State on fakeacc:1 while every thread, the training thread too, has device 0 current (no ``set_device``):
    a pooled async save, one under a host memory budget and a load. No call that opens a context on CUDA (streams,
    side-stream copies, events, pinned allocation, registration) ran with device 0 current, on any thread."""
    from harness import native_state
    from nxd_ckpt.device.transfer import THREAD_NAME

    fake = _fake()
    device = f"{fake.DEVICE_TYPE}:1"
    fake.CALLS.clear()
    native_state.saves_and_loads_on(str(tmp_path), device, WIDTH, autograd=False)
    calls = list(fake.CALLS)
    wrong = sorted({(c.what, c.thread) for c in calls if c.device != 1})
    assert not wrong, f"device work ran with device 0 current (what, thread): {wrong}"
    assert fake.current_device() == 0, "the library left the training thread on another device"
    kinds = {c.what for c in calls}
    expected = {"stream", "copy", "stream wait", "event record", "event synchronize", "pinned alloc"}
    assert expected | {"host register", "host unregister"} <= kinds, f"the scenario did not make {expected - kinds}"
    threads = {c.thread for c in calls}
    assert THREAD_NAME in threads and len(threads - {threading.current_thread().name}) > 1, threads


@run_with_ranks(1)
def test_fetch_from_many_threads_copies_only_on_a_side_stream_that_waited_for_the_clones():
    """16 threads fetch device copies at once while making a stream takes 50 ms: one side stream is made, it waits
    for the clones before any copy is queued on it, and every copy holds its clone's bytes."""
    from harness import native_state
    from nxd_ckpt.device.backend import SnapshotBudget
    from nxd_ckpt.device.snapshot import copy_on_device

    fake = _fake()
    tensors = [torch.full((256,), float(i)).to(f"{fake.DEVICE_TYPE}:1") for i in range(64)]
    copies = copy_on_device(tensors, SnapshotBudget(None))
    clones, ready = [copies.sources[id(t)] for t in tensors], copies.ready
    real_stream = torch.fakeacc.Stream
    barrier = threading.Barrier(16)
    fetched: dict[int, list[torch.Tensor]] = {}

    def slow_stream(*args, **kwargs):
        time.sleep(0.05)  # a wide window: a fetch that does not wait for the first one's stream makes its own
        return real_stream(*args, **kwargs)

    def fetch(i: int) -> None:
        barrier.wait(timeout=30)
        fetched[i] = copies.fetch(clones[4 * i : 4 * i + 4])

    fake.CALLS.clear()
    with native_state.patched() as monkeypatch:
        monkeypatch.setattr(torch.fakeacc, "Stream", slow_stream)
        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert len(fetched) == 16, "a fetch failed or never returned"
    streams = {id(c.stream): c.stream for c in fake.CALLS if c.what == "copy"}
    unwaited = [s for s in streams.values() if not any(e is ready for e in s.waited)]
    assert not unwaited, f"{len(unwaited)} of {len(streams)} side streams got copies without waiting for the clones"
    assert len([c for c in fake.CALLS if c.what == "stream"]) == 1
    for i, out in fetched.items():
        for j, host in enumerate(out):
            assert torch.equal(host, torch.full((256,), float(4 * i + j)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK and /proc/self/smaps are Linux's")
@run_with_ranks(1)
def test_a_child_forked_after_a_save_does_not_inherit_the_registered_staging_buffers(tmp_path):
    """After an async save the pool holds registered staging buffers; a child forked then (a DataLoader's worker)
    has none of their ranges mapped, drops the pool without unregistering or unmapping anything of the parent's,
    and exits cleanly; the parent's buffers are intact, and dropping them unregisters and unmaps them."""
    from harness import native_state
    from harness.mappings import mapping_at
    from nxd_ckpt.manager import CheckpointManager

    fake = _fake()
    manager = CheckpointManager()
    model, opt = native_state.training(f"{fake.DEVICE_TYPE}:1", WIDTH)
    native_state.steps(model, opt, 1, seed=1, autograd=False)
    manager.save(str(tmp_path), "step_1", model=model, optimizer=opt, async_save=True).wait()
    ranges = dict(fake.REGISTERED)
    assert ranges and all(mapping_at(a) is not None for a in ranges), "the save registered no staging buffer"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no library threads; reports through the pipe and leaves with os._exit
        code = 1
        try:
            inherited = [hex(a) for a in ranges if mapping_at(a) is not None]
            calls = len(fake.CALLS)
            manager._staging_pool.pinned.clear()
            gc.collect()
            unregistered = [c.what for c in fake.CALLS[calls:] if c.what == "host unregister"]
            os.write(write, f"inherited {inherited}, unregistered {unregistered}".encode())
            code = 0 if not inherited and not unregistered else 1
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child: {said or 'no word'} (status {status})"
    assert dict(fake.REGISTERED) == ranges and all(mapping_at(a) is not None for a in ranges)
    manager.finalize()
    gc.collect()
    assert fake.REGISTERED == {} and all(mapping_at(a) is None for a in ranges)
