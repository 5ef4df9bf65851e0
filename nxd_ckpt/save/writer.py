"""AsyncWriter: one named background thread that runs checkpoint write jobs in order, and keeps their errors.

Modelled on orbax's ``_AsyncManager`` (one thread, ``check_for_errors`` raises once, ``wait_until_finished``)
and DCP's single-worker executor (``submit`` returns a ``Future``). Jobs run strictly first in, first out, so
a save's commit and its retention deletions always follow its own writes and precede the next save's writes.

Jobs must not issue collectives: they run while the training thread may be inside one. Cross-rank
coordination from a job goes through the c10d store only (see ``barrier.py``).

A failed job does not stop the queue: later jobs still run (a retention job is independent of the next
save). The first unreported error is raised, once, by ``check_for_errors`` as an ``AsyncSaveError`` whose
``__cause__`` is the original exception; errors of further failed jobs are logged and counted in its message.
The thread is a daemon so a forgotten writer cannot hang the interpreter, and an exit hook waits for
pending jobs instead, so interpreter exit never cuts a checkpoint short. When that wait lasts over a second
(e.g. after a Ctrl-C during an async save) it says on stderr what it waits for; a further Ctrl-C abandons the
pending jobs on purpose: the tag never gets ``done``, so the previous complete checkpoint stays the latest.
The hook runs among threading's exit
callbacks, before ``concurrent.futures`` refuses new work at shutdown: jobs use thread pools (parallel file
I/O, fsync batches, boto3's transfer manager), which an ordinary ``atexit`` hook would find already closed.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit callback before ours (see _register_exit_hook)
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from nxd_ckpt.errors import AsyncSaveError
from nxd_ckpt.ranks.failures import format_exception

logger = logging.getLogger("nxd_ckpt")

T = TypeVar("T")

THREAD_NAME = "nxd_ckpt_writer"


@dataclass
class _Job:
    name: str
    fn: Callable[[], Any]
    future: Future


class AsyncWriter:
    """A FIFO of background jobs on one named thread, with deferred error reporting.

    >>> writer = AsyncWriter()
    >>> fut = writer.submit(lambda: 1 + 1, name="demo")
    >>> writer.wait_until_finished()  # doctest: +SKIP
    >>> writer.check_for_errors()  # raises AsyncSaveError if a job failed
    """

    def __init__(self, name: str = THREAD_NAME) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._unfinished = 0
        self._errors: list[tuple[str, BaseException]] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.running: str | None = None
        """Name of the job running now (e.g. ``"save step_3"``), for messages."""
        _live_writers.add(self)

    # ------------------------------------------------------------------ submitting
    def start(self) -> None:
        """Start the thread unless it runs. ``submit`` does too; an async save calls this before its snapshot, so
        that the thread's start does not wait behind the device's work inside the call."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], T], name: str) -> Future[T]:
        """Queue ``fn`` to run after every job submitted before it; return its Future."""
        job = _Job(name=name, fn=fn, future=Future())
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the checkpoint writer is closed; cannot run {name!r}")
            self._unfinished += 1
            self._start_locked()
        self._queue.put(job)
        return job.future

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._unfinished

    # ------------------------------------------------------------------ waiting and errors
    def wait_until_finished(self, timeout: float | None = None) -> float:
        """Block until every submitted job has run; return the seconds waited. Does not raise job errors."""
        start = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._unfinished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._unfinished} checkpoint job(s) still running after {timeout} s")
                self._idle.wait(remaining)
        return time.perf_counter() - start

    def check_for_errors(self) -> None:
        """Raise (once) the first error of a job that failed since the last call, chained as ``__cause__``."""
        with self._lock:
            errors, self._errors = self._errors, []
        if not errors:
            return
        name, first = errors[0]
        more = f" (and {len(errors) - 1} later job(s) failed too; see the log)" if len(errors) > 1 else ""
        raise AsyncSaveError(f"background checkpoint job {name!r} failed: {format_exception(first)}{more}") from first

    def close(self) -> None:
        """Wait for pending jobs, then stop the thread. Errors stay available to ``check_for_errors``.

        After jobs were abandoned at exit (a second Ctrl-C), nothing is waited for."""
        if _abandoned_at_exit.is_set():
            return
        self.wait_until_finished()
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        _live_writers.discard(self)

    def __del__(self) -> None:
        if getattr(self, "_unfinished", 0) and not getattr(self, "_closed", True):
            logger.warning("AsyncWriter dropped with %d checkpoint job(s) still pending", self._unfinished)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.future.set_running_or_notify_cancel():
                self.running = job.name
                try:
                    job.future.set_result(job.fn())
                except BaseException as e:
                    logger.error(
                        "background checkpoint job %r failed (raised by the next save or finalize): %s",
                        job.name,
                        format_exception(e),
                    )
                    with self._lock:
                        self._errors.append((job.name, e))
                    job.future.set_exception(e)
            self.running = None
            del job  # drop references to staged state before idling
            with self._idle:
                self._unfinished -= 1
                if self._unfinished == 0:
                    self._idle.notify_all()


_live_writers: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()
"""Writers not yet closed, waited for at interpreter exit (weak: a dropped writer is not kept alive)."""


EXIT_NOTICE_AFTER_S = 1.0
"""At exit, say what the process waits for once the wait has lasted this long."""

_abandoned_at_exit = threading.Event()
"""Set when a second interrupt at exit gave up on pending jobs: nothing waits for them any more."""


def _say(message: str) -> None:
    """A line on stderr at exit, whatever logging is configured (the user is looking at a terminal that hangs)."""
    try:
        sys.stderr.write(f"nxd_ckpt: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed
        pass


def _wait_at_exit() -> None:
    """At exit: let pending checkpoint jobs finish, saying so; a (further) Ctrl-C abandons them deliberately.

    Abandoning is safe by construction: a tag counts only once ``done`` is written, last, so an abandoned save
    leaves an incomplete tag and the previous complete checkpoint stays the latest.
    """
    try:
        for writer in list(_live_writers):
            if not writer.pending:
                continue
            try:
                writer.wait_until_finished(timeout=EXIT_NOTICE_AFTER_S)
            except TimeoutError:
                _say(
                    f"waiting for the background checkpoint job {writer.running or 'queued'!r} to finish writing "
                    f"({writer.pending} job(s) pending) before exiting. Press Ctrl-C again to abandon it: that "
                    "checkpoint then gets no 'done' and the previous complete checkpoint stays the latest."
                )
                writer.wait_until_finished()
                _say("checkpoint writes finished; exiting")
            with writer._lock:
                errors = list(writer._errors)
            for name, error in errors:
                logger.error("checkpoint job %r failed and was never reported: %s", name, format_exception(error))
    except KeyboardInterrupt:
        _abandoned_at_exit.set()
        pending = [f"{w.running or 'queued'!r}" for w in list(_live_writers) if w.pending]
        _say(
            f"interrupted: abandoned the pending checkpoint job(s) {', '.join(pending) or ''} without writing "
            "'done'; the previous complete checkpoint stays the latest"
        )


def _register_exit_hook() -> None:
    """Run ``_wait_at_exit`` before ``concurrent.futures`` shuts its executors down at exit.

    threading calls its exit callbacks in reverse order of registration, before ``atexit`` hooks; this one is
    registered after concurrent.futures' own (imported above), so it runs first. Falls back to ``atexit``.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_wait_at_exit)
    except RuntimeError:  # very old Python, or imported while the interpreter is already shutting down
        atexit.register(_wait_at_exit)


_register_exit_hook()
