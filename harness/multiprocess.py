"""Run a plain (pytest) function on N spawned ranks with a real gloo process group.

    @run_with_ranks(4)
    def test_dp4(tmp_path):
        ...  # runs on 4 processes; torch.distributed is initialised (gloo), rank from dist.get_rank()

The decorated function is re-imported by module and name in each child, so it must live at module level. Each
rank's exception and traceback is reported by the parent. Ranks are fresh processes forked from a forkserver that
imported torch (and torch_xla, nxd_ckpt, where the parent uses them) once per test session, so a rank starts in a
fraction of a second instead of importing torch again; each rank gets the parent's environment as it is at the
call (monkeypatched variables included), not the server's.

``ranks_per_node`` numbers the ranks as torchrun does on several nodes (LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK per simulated node); ``sigkill_ok`` accepts ranks that end by SIGKILL (a simulated crash) as passed.

The ranks meet at a TCPStore the parent serves on a port it bound itself (``harness.rendezvous``): no port is
ever chosen, released and bound again later. ``MASTER_PORT`` in each rank is that store's port.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from harness import rendezvous

_RANK_ENV = "NXD_CKPT_TEST_RANK"
_HARNESS_PID_ENV = "NXD_CKPT_TEST_HARNESS_PID"
_GROUP_TIMEOUT_S = 120.0
_PRELOAD = (
    "numpy",
    "torch",
    "torch_xla",
    "torch_xla.core.xla_model",
    "nxd_ckpt",
    "nxd_ckpt.api",
    "nxd_ckpt.testing.fakes",
    "harness.crashloop",
)
"""What the ranks' forkserver imports once, among the modules the parent has imported itself."""


def rank_context(*modules: str) -> Any:
    """The multiprocessing context test processes start from: a forkserver that preloads torch and friends (and
    ``modules``); the preload list is fixed by whichever caller starts the server first in this process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules] + list(modules))
    return ctx


def _rank_main(
    module: str,
    qualname: str,
    rank: int,
    world_size: int,
    port: int,
    kwargs: dict[str, Any],
    results: Any,
    sys_path: list[str],
    extra_env: dict[str, str],
    ranks_per_node: int | None = None,
    environ: dict[str, str] | None = None,
    harness_pid: int = 0,
) -> None:
    sys.path[:] = sys_path
    if environ is not None:  # the parent's environment at the call, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
    per_node = ranks_per_node or world_size
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            _RANK_ENV: str(rank),
            _HARNESS_PID_ENV: str(harness_pid),
            **extra_env,
        }
    )
    try:
        rendezvous.init_process_group(port, rank, world_size, _GROUP_TIMEOUT_S)
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        fn = getattr(obj, "__rank_fn__", obj)
        fn(**kwargs)
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        try:
            import nxd_ckpt

            nxd_ckpt.reset_manager()
        except BaseException:
            pass
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:
            pass


def harness_pid() -> int:
    """In a rank: the process that started it and serves its store (a rank's OS parent is the forkserver)."""
    return int(os.environ[_HARNESS_PID_ENV])


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
    sigkill_ok: bool = False,
) -> None:
    """Run module-level function ``fn(**kwargs)`` on ``world_size`` spawned gloo ranks; raise if any failed."""
    if ranks_per_node is not None and (ranks_per_node < 1 or world_size % ranks_per_node):
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={world_size}")
    ctx = rank_context()
    results = ctx.Queue()
    store = rendezvous.serve_store(_GROUP_TIMEOUT_S)  # served here until every rank has ended
    port = int(store.port)
    module, qualname = fn.__module__, fn.__qualname__
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                module,
                qualname,
                r,
                world_size,
                port,
                kwargs or {},
                results,
                list(sys.path),
                env or {},
                ranks_per_node,
                dict(os.environ),
                os.getpid(),
            ),
            name=f"rank{r}",
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    failures: dict[int, str] = {}
    reported: set[int] = set()
    deadline, shortened = time.monotonic() + timeout, False
    while len(reported) < world_size:
        try:
            rank, err = results.get(timeout=0.5)
            reported.add(rank)
            if err is not None:
                failures[rank] = err
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in reported]
            if dead and all(not p.is_alive() for p in procs):
                for i in dead:
                    if not (sigkill_ok and procs[i].exitcode == -signal.SIGKILL):
                        failures[i] = f"rank {i} exited with code {procs[i].exitcode} without reporting"
                break
            if time.monotonic() > deadline:
                for i in range(world_size):
                    if i not in reported:
                        failures[i] = f"rank {i} timed out after {timeout:.0f} s"
                break
        if failures and not shortened:  # one rank failed: the others get 20 s to report, not the full timeout
            deadline, shortened = min(deadline, time.monotonic() + 20), True
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    del store
    if failures:
        details = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{details}")


def run_with_ranks(
    world_size: int, timeout: float = 240.0, env: dict[str, str] | None = None, ranks_per_node: int | None = None
) -> Callable:
    """Decorator form of ``run_on_ranks`` for plain pytest functions (fixtures arrive as keyword arguments)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("run_with_ranks functions take keyword arguments (pytest fixtures) only")
            run_on_ranks(wrapper, world_size, kwargs, timeout=timeout, env=env, ranks_per_node=ranks_per_node)

        wrapper.__rank_fn__ = fn  # type: ignore[attr-defined]
        return wrapper

    return decorator
