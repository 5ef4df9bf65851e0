"""Fault injection: ranks that save a deterministic state every step until they are SIGKILLed.

``CrashLoop.run_once(delay)`` starts ``world_size`` gloo ranks (forked from a forkserver that has already
imported torch and nxd_ckpt, so a start costs tens of milliseconds, not seconds), lets them save
``step_NNNNN`` tags in a loop, and SIGKILLs every rank after ``delay`` seconds. The state of step ``s`` is a
pure function of ``s`` (``model_state``/``optimizer_state``), so whatever tag a later load reports, the test
knows exactly what it must hold.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

import nxd_ckpt as nxd
from harness import rendezvous
from harness.multiprocess import rank_context

TENSORS = 4
ROWS = 256


def tag_for(step: int) -> str:
    return f"step_{step:05d}"


def step_of(tag: str) -> int:
    return int(tag.rsplit("_", 1)[1])


def _tensor(step: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1009 + salt)
    return torch.randn(ROWS, ROWS, generator=g)


def model_state(step: int) -> dict[str, torch.Tensor]:
    """The model state saved at ``step`` (the same on every DP replica)."""
    return {f"layer{i}.weight": _tensor(step, i) for i in range(TENSORS)}


def optimizer_state(step: int) -> dict[str, Any]:
    """The optimizer state saved at ``step``, shaped like ``torch.optim.Optimizer.state_dict()``."""
    state = {i: {"step": torch.tensor(float(step)), "exp_avg": _tensor(step, 100 + i)} for i in range(TENSORS)}
    return {"state": state, "param_groups": [{"lr": 0.01, "params": list(range(TENSORS))}]}


def _rank_main(ckpt_dir: str, port: int, rank: int, world_size: int, start_step: int, options: dict[str, Any]) -> None:
    """One rank of the saving loop; runs until killed. ``port`` is the parent's rendezvous store."""
    os.environ.update({"MASTER_ADDR": rendezvous.HOST, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    rendezvous.init_process_group(port, rank, world_size, timeout_s=60.0)
    step = start_step
    while True:
        nxd.save_checkpoint(
            ckpt_dir,
            tag_for(step),
            model=model_state(step),
            optimizer=optimizer_state(step),
            user_content={"step": step},
            **options,
        )
        step += 1


@dataclass
class CrashLoop:
    """Runs the saving loop in ``ckpt_dir`` and kills it; ``options`` go to ``save_checkpoint``."""

    ckpt_dir: str
    world_size: int = 2
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._ctx = rank_context(__name__)

    def run_once(self, delay: float) -> None:
        """Start the ranks at the step after the newest complete tag and SIGKILL all of them after ``delay`` s."""
        latest = nxd.latest_checkpoint_tag(self.ckpt_dir) if os.path.isdir(self.ckpt_dir) else None
        start = step_of(latest) + 1 if latest else 1
        store = rendezvous.serve_store(60.0)  # a new store (so new keys) per run, served until the kill
        port = int(store.port)
        procs = [
            self._ctx.Process(
                target=_rank_main,
                args=(self.ckpt_dir, port, r, self.world_size, start, dict(self.options or {})),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in procs:
            p.start()
        time.sleep(delay)
        for p in procs:  # all ranks, back to back: a node losing power
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
        del store
        crashed = [p.exitcode for p in procs if p.exitcode not in (-signal.SIGKILL,)]
        if crashed:
            raise AssertionError(f"a saving rank exited on its own before the kill (exit codes {crashed})")


def _kill_at_call(
    kill_after: int, names: tuple[str, ...], log_path: str | None = None, write_opens: bool = False
) -> list[int]:
    """Wrap the ``os`` functions ``names`` so this process SIGKILLs itself at their ``kill_after``-th call in all
    (never, if negative); returns the call counter (``[n]``). ``write_opens``: opening a file for writing (the
    built-in ``open``, which ``pathlib`` and DCP's own writer use) counts as a call too, logged as ``open``.

    The calls are serialized by one lock, held through each call, so a kill lands between two mutations and never
    beside one another thread is making. With ``log_path``, each call that ran is appended there as
    ``name<TAB>arg<TAB>arg``: which mutations a killed run made, by name, whatever order its threads took."""
    calls = [0]
    lock = threading.RLock()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log_path else -1

    def counted(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                if calls[0] == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls[0] += 1
                result = real(*args, **kwargs)
                if log_fd >= 0:
                    fields = [name, *(str(a) for a in args if isinstance(a, (str, bytes, os.PathLike)))]
                    os.write(log_fd, ("\t".join(fields) + "\n").encode())
                return result

        return wrapper

    for name in names:
        setattr(os, name, counted(name, getattr(os, name)))
    if write_opens:
        _count_write_opens(counted("open", io.open))
    return calls


def _count_write_opens(counted_open: Any) -> None:
    """Route the built-in ``open`` (also ``io.open``, which ``pathlib`` calls) through ``counted_open`` when a
    file is opened for writing; reads pass straight through."""
    real = io.open

    def open_file(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+"):
            return counted_open(file, mode, *args, **kwargs)
        return real(file, mode, *args, **kwargs)

    io.open = builtins.open = open_file  # type: ignore[assignment]


def read_mutation_log(log_path: str) -> list[tuple[str, ...]]:
    """The mutations a ``run_resave(..., log_path=...)`` made, in order: ``(name, *path arguments)``."""
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]


def _retention_child(ckpt_dir: str, keep: int, kill_after: int) -> None:
    """Apply retention, SIGKILLing this process at its ``kill_after``-th unlink/rmdir (never, if negative)."""
    from nxd_ckpt.format import retention
    from nxd_ckpt.storage import LocalStorage

    calls = _kill_at_call(kill_after, ("unlink", "remove", "rmdir"))
    retention.apply_retention(LocalStorage(ckpt_dir), retention.KeepLatest(keep))
    os._exit(100 + min(calls[0], 100))  # reports how many deletions a full run made


def run_retention(ckpt_dir: str, keep: int, kill_after: int = -1) -> int:
    """Run retention in a forked process killed at its ``kill_after``-th deletion; return the deletions made
    by a run that finished (-1 when it was killed)."""
    ctx = rank_context(__name__)
    p = ctx.Process(target=_retention_child, args=(ckpt_dir, keep, kill_after), daemon=True)
    p.start()
    p.join(timeout=60)
    if p.exitcode == -signal.SIGKILL:
        return -1
    if p.exitcode is None or p.exitcode < 100:
        raise AssertionError(f"retention process failed (exit code {p.exitcode})")
    return p.exitcode - 100


_SAVE_AND_LOAD = (nxd.save_checkpoint, nxd.load_checkpoint)
"""Looked up when this module is imported, so that the save and load path (which ``nxd_ckpt`` imports on first use)
is imported then: the forkserver preloads this module, and a forked child starts with that path loaded instead of
importing it (seconds per child without bytecode caches)."""

_MUTATIONS = ("replace", "rename", "unlink", "remove", "rmdir", "fsync", "mkdir")
"""The os functions through which a save changes or makes durable what is on disk."""


def _resave_child(
    ckpt_dir: str, tag: str, version: int, kill_after: int, options: dict[str, Any], log_path: str | None
) -> None:
    """Save ``tag`` at ``version`` in one process, SIGKILLing it at its ``kill_after``-th filesystem mutation
    (on any thread, so async writer threads too; never, if negative). One intra-op thread: a forked child's
    first tensor copies otherwise spend longer starting a thread pool than copying this small state."""
    torch.set_num_threads(1)
    calls = _kill_at_call(kill_after, _MUTATIONS, log_path)
    report = nxd.save_checkpoint(
        ckpt_dir,
        tag,
        model=model_state(version),
        optimizer=optimizer_state(version),
        user_content={"version": version},
        **options,
    )
    report.wait()
    nxd.finalize_checkpoint()
    os._exit(100 + min(calls[0], 150))  # reports how many mutations a full run made


def run_resave(
    ckpt_dir: str,
    tag: str,
    version: int,
    kill_after: int = -1,
    options: dict[str, Any] | None = None,
    log_path: str | None = None,
) -> int:
    """Save ``tag`` with the state of ``version`` (``model_state(version)``, user content ``{"version": v}``) in a
    forked process killed at its ``kill_after``-th filesystem mutation; return the mutations a run that finished
    made (-1 when it was killed). With ``log_path``, the mutations that ran are logged there (``read_mutation_log``)."""
    ctx = rank_context(__name__)
    args = (ckpt_dir, tag, version, kill_after, dict(options or {}), log_path)
    p = ctx.Process(target=_resave_child, args=args, daemon=True)
    p.start()
    p.join(timeout=120)
    if p.exitcode == -signal.SIGKILL:
        return -1
    if p.exitcode is None or p.exitcode < 100:
        raise AssertionError(f"re-saving process failed (exit code {p.exitcode})")
    return p.exitcode - 100
