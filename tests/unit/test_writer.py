"""AsyncWriter: FIFO order on one named thread, errors raised once and chained, waiting, closing, exit."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import threading

import pytest

from nxd_ckpt.errors import AsyncSaveError
from nxd_ckpt.writer import THREAD_NAME, AsyncWriter


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
        from nxd_ckpt.writer import AsyncWriter
        writer = AsyncWriter()
        gate = threading.Event()
        writer.submit(lambda: gate.wait(0.5), name="slow")
        writer.submit(lambda: open({str(target)!r}, "w").write("durable"), name="write")
        # the script ends here without waiting: the atexit hook must let both jobs finish
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert target.read_text() == "durable"
