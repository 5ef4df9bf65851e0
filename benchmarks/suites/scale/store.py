"""The c10d store of the simulation: served by a child process (a job's store runs on one node), and the time it
takes to release ``n`` waiting ranks. ``python -m benchmarks.suites.scale.store --serve-store`` and
``--release-waiters PORT N ROUNDS`` are the child processes."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks.core.child import REPO


def _command(*args: str) -> list[str]:
    """This module run as a child process with ``args``."""
    return [sys.executable, "-m", "benchmarks.suites.scale.store", *args]


def _env() -> dict[str, str]:
    """The child's environment: this repository first on its path (it may start elsewhere)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}


def release_waiters(port: int, n: int, rounds: int) -> None:
    """The child of ``store_release_s``: ``n`` connections, each waiting on a thread for each round's key."""
    import datetime

    import torch.distributed as dist

    from nxd_ckpt.testing.threadworld import connect

    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {os.cpu_count() - 1})  # the other core: the server keeps its own
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
    clients = connect(base, n)
    for k in range(rounds):

        def wait(client: Any, k: int = k) -> None:
            client.add(f"ready/{k}", 1)
            client.wait([f"go/{k}"], datetime.timedelta(seconds=600))

        threads = [threading.Thread(target=wait, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def store_release_s(n: int, rounds: int = 3) -> float:
    """Seconds the store takes to release ``n`` waiting ranks (median of ``rounds``): from the ``set`` of the key
    they wait for until the reply to the setter's next request, which the store's one event loop serves after
    it has sent every waiter its wake-up. The waiters are threads of a child process on the other core, so the
    server's work is timed, not the waiters' (a job's ranks wake on their own nodes)."""
    import subprocess

    from nxd_ckpt.ranks.coordinator import local_store

    cpus = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {0})  # the store's server thread, made now, inherits this core
    try:
        store = local_store(600.0)
    finally:
        os.sched_setaffinity(0, cpus)
    child = subprocess.Popen(_command("--release-waiters", str(store.port), str(n), str(rounds)), env=_env())
    times = []
    try:
        for k in range(rounds):
            deadline = time.monotonic() + 600
            while int(store.add(f"ready/{k}", 0)) < n:
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {n} waiting connections did not come up (child exit {child.poll()})")
                time.sleep(0.05)
            time.sleep(0.5)  # every waiter is inside its wait
            start = time.perf_counter()
            store.set(f"go/{k}", b"1")
            store.add("probe", 0)
            times.append(time.perf_counter() - start)
        child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    return statistics.median(times)


def serve_store() -> None:
    """The child of ``StoreProcess``: a TCPStore server; prints its port, serves until its stdin closes."""
    from nxd_ckpt.ranks.coordinator import local_store

    store = local_store(1800.0)
    print(store.port, flush=True)
    sys.stdin.read()


class StoreProcess:
    """A TCPStore served by a child process (a job's store runs on one node, not inside every rank), and a
    client of it: at 4,096 thread ranks, three connections per rank (its own, its waiting one, its writer's)
    are 12,288 sockets here, and the server's ends would double that past the open-file limit."""

    def __enter__(self) -> Any:
        import datetime
        import subprocess

        import torch.distributed as dist

        self.child = subprocess.Popen(
            _command("--serve-store"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )
        line = self.child.stdout.readline() if self.child.stdout else ""
        if not line.strip().isdigit():
            self.child.kill()
            raise RuntimeError(f"the store process did not start (it printed {line!r})")
        return dist.TCPStore("127.0.0.1", int(line), is_master=False, timeout=datetime.timedelta(seconds=1800))

    def __exit__(self, *exc: Any) -> None:
        if self.child.stdin:
            self.child.stdin.close()
        try:
            self.child.wait(timeout=30)
        except Exception:
            self.child.kill()


def child_main(argv: list[str]) -> int:
    """The child processes of this module: ``--serve-store`` or ``--release-waiters PORT N ROUNDS``."""
    if argv[:1] == ["--release-waiters"]:
        release_waiters(*map(int, argv[1:4]))
        return 0
    if argv[:1] == ["--serve-store"]:
        serve_store()
        return 0
    raise SystemExit(f"benchmarks.suites.scale.store: unknown arguments {argv}; --serve-store or --release-waiters")


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
