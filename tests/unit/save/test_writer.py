"""AsyncWriter: FIFO order on one named thread, errors raised once and chained, waiting, closing, exit."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import threading

import pytest

from nxd_ckpt.errors import AsyncSaveError
from nxd_ckpt.save.writer import THREAD_NAME, AsyncWriter


def test_jobs_run_in_submission_order_on_one_named_thread():
    writer = AsyncWriter()
    gate = threading.Event()
    seen: list[tuple[int, str]] = []
    futures = [writer.submit(gate.wait, name="gate")]
    for i in range(5):
        futures.append(writer.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i, name=f"j{i}"))
    assert writer.pending == 6 and seen == []  # all queued behind the blocked first job
    gate.set()
    writer.wait_until_finished()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {name for _, name in seen} == {THREAD_NAME}
    assert [f.result() for f in futures[1:]] == [0, 1, 2, 3, 4]
    assert writer.pending == 0
    writer.close()


def test_error_is_raised_once_with_the_original_chained_and_later_jobs_still_run():
    writer = AsyncWriter()
    original = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_1/model/x.pt")

    def fail() -> None:
        raise original

    failed = writer.submit(fail, name="save step_1")
    after = writer.submit(lambda: "retention ran", name="retention after step_1")
    writer.wait_until_finished()  # waiting never raises: the error is kept for the next call
    assert after.result() == "retention ran"
    assert failed.exception() is original
    with pytest.raises(AsyncSaveError, match="save step_1.*No space left on device") as info:
        writer.check_for_errors()
    assert info.value.__cause__ is original
    writer.check_for_errors()  # raised once: nothing left
    writer.close()


def test_several_failures_raise_the_first_and_count_the_rest():
    writer = AsyncWriter()
    first, second = PermissionError(errno.EACCES, "denied"), ValueError("second")
    for name, error in (("a", first), ("b", second)):
        writer.submit(lambda e=error: (_ for _ in ()).throw(e), name=name)
    writer.wait_until_finished()
    with pytest.raises(AsyncSaveError, match=r"'a' failed.*1 later job\(s\) failed") as info:
        writer.check_for_errors()
    assert info.value.__cause__ is first
    writer.close()


def test_wait_until_finished_times_out_while_a_job_is_stuck_then_completes():
    writer = AsyncWriter()
    gate = threading.Event()
    writer.submit(gate.wait, name="stuck")
    with pytest.raises(TimeoutError, match="1 checkpoint job"):
        writer.wait_until_finished(timeout=0.05)
    gate.set()
    assert writer.wait_until_finished(timeout=60) >= 0.0
    writer.close()


def test_close_waits_for_pending_jobs_and_refuses_new_ones():
    writer = AsyncWriter()
    gate = threading.Event()
    done: list[str] = []
    thread = writer.submit(threading.current_thread, name="which thread")
    writer.submit(gate.wait, name="gate")
    writer.submit(lambda: done.append("last"), name="last")
    threading.Timer(0.05, gate.set).start()
    writer.close()
    assert done == ["last"]
    assert not thread.result().is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(lambda: None, name="too late")


def test_interpreter_exit_waits_for_pending_jobs(tmp_path):
    target = tmp_path / "written.txt"
    script = textwrap.dedent(
        f"""
        import threading
        from nxd_ckpt.save.writer import AsyncWriter
        writer = AsyncWriter()
        gate = threading.Event()
        writer.submit(lambda: gate.wait(0.5), name="slow")
        writer.submit(lambda: open({str(target)!r}, "w").write("durable"), name="write")
        # the script ends here without waiting: the atexit hook must let both jobs finish
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert target.read_text() == "durable"


_INTERRUPTED_SAVE = """
import os, signal, sys, threading, time
# The child is a program in a terminal, whatever its parent ignores: a job started in the background by a
# shell without job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
import nxd_ckpt as nxd
from nxd_ckpt import statefile

ckpt_dir = sys.argv[1]
model = torch.nn.Linear(4, 4)
nxd.save_checkpoint(ckpt_dir, "step_1", model=model)  # complete: the one that must stay the latest
real_write, stuck = statefile.write_plain, threading.Event()

def slow_write(*args, **kwargs):  # a storage that stalls: the async save of step_2 never finishes by itself
    stuck.set()
    time.sleep(120)
    return real_write(*args, **kwargs)

statefile.write_plain = slow_write
nxd.save_checkpoint(ckpt_dir, "step_2", model=model, async_save=True)
stuck.wait(60)
print("saving", flush=True)
raise KeyboardInterrupt  # the user's first Ctrl-C, while step_2 is being written
"""


def test_ctrl_c_during_an_async_save_says_what_it_waits_for_and_a_second_one_abandons_it(tmp_path):
    """First interrupt: the process says what it waits for and what another Ctrl-C does. Second: it exits at
    once, deliberately, leaving the tag without 'done' (so the previous checkpoint stays the latest)."""
    import signal
    import time

    import nxd_ckpt as nxd

    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_SAVE, str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "saving"
        notice = ""
        deadline = time.monotonic() + 60
        while "Press Ctrl-C again" not in notice and time.monotonic() < deadline:
            notice += proc.stderr.readline()
        assert "waiting for the background checkpoint job 'save step_2' to finish writing" in notice, notice
        assert "the previous complete checkpoint stays the latest" in notice
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)  # abandoned: no 120 s wait
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted: abandoned the pending checkpoint job(s) 'save step_2' without writing 'done'" in rest
    assert "Exception ignored" not in notice + rest
    assert not (ckpt / "step_2" / "done").exists()
    assert nxd.latest_checkpoint_tag(str(ckpt)) == "step_1"
