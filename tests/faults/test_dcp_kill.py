"""A DCP save killed at any moment never loses the previous checkpoint (nxd_ckpt.dcp.StorageWriter), and what DCP's
own FileSystemWriter loses in the same kills (the figures in docs/torchtitan.md).

Each save runs in a forked single process (``dcp.save(..., no_dist=True)``) SIGKILLed at its N-th filesystem
mutation (file opened for writing, rename, fsync, unlink, mkdir, rmdir), for every N a finished save makes, in
three cases: saving again into the folder that holds the previous checkpoint (TorchTitan's last step re-saved, a
job restarted at the same step), saving a new folder beside it, and the re-save with two files per rank. After each
kill the folders are loaded with DCP's own FileSystemReader (no recovery step run first) and checked bit-exactly.
"""

from __future__ import annotations

import os
import shutil

import pytest

from harness.dcp_crash import loaded_version, run_dcp_save

pytestmark = [
    pytest.mark.device_independent,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # about 200 forked saves, each killed or finished
]

CASES = (("resave", 1), ("new_folder", 1), ("resave", 2))
"""(what the save does, files per rank)."""


def _outcome(root: str, case: str, verified: bool) -> str:
    """What the folders load as after a kill: 'old', 'new' (the killed save had committed), or 'lost: ...'."""
    previous = loaded_version(os.path.join(root, "step-1"), verified)
    if case == "resave":
        return {1: "old", 2: "new"}.get(previous, "lost: step-1 does not load")  # type: ignore[arg-type]
    if previous != 1:
        return "lost: step-1 does not load"
    if not os.path.exists(os.path.join(root, "step-2", ".metadata")):
        return "old"
    return "new" if loaded_version(os.path.join(root, "step-2"), verified) == 2 else "lost: step-2 is damaged"


def _kill_at_every_mutation(tmp_path: str, writer: str, case: str, threads: int) -> list[str]:
    """The outcome of a kill at each mutation of the save ``case`` through ``writer``."""
    base = os.path.join(tmp_path, f"{writer}-{case}-{threads}")
    pristine = os.path.join(base, "pristine")
    assert run_dcp_save(os.path.join(pristine, "step-1"), 1, writer, threads) > 0
    target = "step-1" if case == "resave" else "step-2"
    full = os.path.join(base, "full")
    shutil.copytree(pristine, full)
    mutations = run_dcp_save(os.path.join(full, target), 2, writer, threads)
    assert _outcome(full, case, verified=False) == "new"
    outcomes = []
    for kill_after in range(mutations):
        root = os.path.join(base, f"k{kill_after}")
        shutil.copytree(pristine, root)
        assert run_dcp_save(os.path.join(root, target), 2, writer, threads, kill_after=kill_after) == -1
        outcomes.append(_outcome(root, case, verified=False))
        if writer == "nxd_ckpt":
            assert _outcome(root, case, verified=True) == outcomes[-1], kill_after  # our reader agrees
            if case == "resave":  # the next save settles what the kill left, and leaves nothing hidden
                assert run_dcp_save(os.path.join(root, target), 3, writer, threads) > 0
                assert loaded_version(os.path.join(root, target), verified=True) == 3
                assert sorted(os.listdir(root)) == ["step-1"], kill_after
        shutil.rmtree(root)
    return outcomes


def test_a_killed_dcp_save_never_loses_the_previous_checkpoint(tmp_path, capsys):
    figures = {}
    for writer in ("nxd_ckpt", "dcp"):
        for case, threads in CASES:
            outcomes = _kill_at_every_mutation(str(tmp_path), writer, case, threads)
            figures[(writer, case, threads)] = outcomes
    with capsys.disabled():
        print("\nDCP save SIGKILLed at every filesystem mutation (stock FileSystemReader loads afterwards):")
        print(f"{'writer':10} {'case':11} {'files':>5} {'kills':>5} {'old':>4} {'new':>4} {'lost':>4}")
        for (writer, case, threads), outcomes in figures.items():
            lost = sum(o.startswith("lost") for o in outcomes)
            old, new = outcomes.count("old"), outcomes.count("new")
            print(f"{writer:10} {case:11} {threads:>5} {len(outcomes):>5} {old:>4} {new:>4} {lost:>4}")
    ours = [o for (writer, _, _), outs in figures.items() if writer == "nxd_ckpt" for o in outs]
    assert len(ours) >= 50
    assert [o for o in ours if o.startswith("lost")] == []
    for (writer, _, _), outcomes in figures.items():
        if writer == "nxd_ckpt":  # once the save committed, every later kill finds the new checkpoint
            assert outcomes == sorted(outcomes, key=lambda o: o == "new"), outcomes
    stock_resave = figures[("dcp", "resave", 1)]
    assert any(o.startswith("lost") for o in stock_resave), stock_resave  # the kills reach what can be lost
