"""save/commit.py is the one owner of the atomic commit: the NxD path and the DCP writer both end a save through
``complete_folder`` (each with its ``layout.CommitLayout``), and no other module writes a completion marker or
swaps a folder in."""

from __future__ import annotations

import ast
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nxd_ckpt as nxd
from nxd_ckpt.dcp import StorageReader, StorageWriter, recover_folder
from nxd_ckpt.format import layout
from nxd_ckpt.save import commit
from nxd_ckpt.testing.fakes import assert_state_equal, make_training

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

PACKAGE = os.path.dirname(os.path.abspath(nxd.__file__))

MARKER_NAMES = {"DONE_MARKER", "DCP_METADATA_FILE", "METADATA", "marker"}
"""How the package names a completion marker (``done``, ``.metadata``, a ``CommitLayout``'s ``marker``)."""

MARKER_WRITERS = {
    "save/commit.py": "complete_folder: the completion marker, last",
    "format/resave.py": "the swap by copy on object stores moves a complete copy's marker to the tag, last",
    "dcp/writer.py": "_seal_tier: .metadata into the memory tier's node share, whose completion is the tier's seal",
}
"""The modules that may write a completion marker, and why."""

FOLDER_SWAPPERS = {"save/commit.py", "format/resave.py", "format/tags.py"}
"""The modules that may name the re-save mechanics (tags.py: their old import path)."""
SWAP_NAMES = {"ResaveStorage", "begin_resave", "swap_in_resave", "replace_dir", "recover_resave"}


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    trees[os.path.relpath(path, PACKAGE).replace(os.sep, "/")] = ast.parse(f.read())
    return trees


def _names(node: ast.AST) -> set[str]:
    """Every name, attribute and imported name mentioned in ``node``."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            found |= {alias.name for alias in n.names}
    return found


def test_only_the_commit_writes_completion_markers():
    writers = {
        module
        for module, tree in _modules().items()
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "write_bytes"
        and call.args
        and _names(call.args[0]) & MARKER_NAMES
    }
    assert writers == set(MARKER_WRITERS)


def test_only_the_commit_stages_and_swaps_folders():
    users = {module for module, tree in _modules().items() if _names(tree) & SWAP_NAMES}
    assert users == FOLDER_SWAPPERS
    dcp_imports = {
        alias.name
        for module, tree in _modules().items()
        if module.startswith("dcp/")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if node.module == "nxd_ckpt.save"
    }
    assert "commit" in dcp_imports


@pytest.fixture
def completions(monkeypatch) -> list[tuple[str, layout.CommitLayout, bool]]:
    """Every ``commit.complete_folder`` call, recorded (folder, layout, staged) and then made for real."""
    calls: list[tuple[str, layout.CommitLayout, bool]] = []
    real = commit.complete_folder

    def recording(storage: Any, folder: str, marker: bytes, swap_in: Any, spec: Any = layout.NXD_COMMIT) -> None:
        calls.append((folder, spec, swap_in is not None))
        real(storage, folder, marker, swap_in, spec)

    monkeypatch.setattr(commit, "complete_folder", recording)
    return calls


def _dcp_roundtrip(path: str, seed: int) -> None:
    state = {"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)), "step": seed}
    dcp.save(state, storage_writer=StorageWriter(path), no_dist=True)
    out = {"w": torch.zeros(8, 4), "step": -1}
    dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == seed


def test_both_front_ends_commit_through_complete_folder(tmp_path, completions):
    """A save and a re-save through each front end: each ends in ``complete_folder`` with its own layout, the
    re-save staged and swapped in, and each checkpoint loads back."""
    model, opt, _ = make_training(seed=1)
    for _ in range(2):
        nxd.save_checkpoint(tmp_path / "nxd", "t", model=model, optimizer=opt)
    loaded, _, _ = make_training(seed=2)
    nxd.load_checkpoint(tmp_path / "nxd", model=loaded)
    assert_state_equal(model.state_dict(), loaded.state_dict())
    for seed in (1, 2):
        _dcp_roundtrip(str(tmp_path / "dcp" / "step-1"), seed)
    assert completions == [
        ("t", layout.NXD_COMMIT, False),
        ("t", layout.NXD_COMMIT, True),
        ("step-1", layout.DCP_COMMIT, True),
        ("step-1", layout.DCP_COMMIT, True),
    ]
    assert sorted(os.listdir(tmp_path / "dcp")) == ["step-1"]


def test_a_complete_dcp_save_left_beside_its_folder_is_swapped_in_by_recovery(tmp_path):
    """The recovery the NxD path has (a complete re-save a crash left unswapped takes the name), for DCP folders:
    the staged copy with its ``.metadata`` replaces the folder whose replacement was cut short."""
    path = str(tmp_path / "step-1")
    _dcp_roundtrip(path, 1)
    staging = tmp_path / layout.DCP_COMMIT.staging_dir("step-1")
    os.rename(path, staging)  # as if killed after `.metadata` was written in staging, before the swap
    os.makedirs(path)  # ... with a half-written folder under the name (no .metadata)
    recover_folder(path)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    out = {"w": torch.zeros(8, 4), "step": -1}
    dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
    assert out["step"] == 1


def test_recovery_keeps_a_complete_dcp_folder_over_a_complete_staged_copy(tmp_path):
    """DCP copies carry no creation time: with both complete, the folder stays and the staged copy is dropped."""
    path = str(tmp_path / "step-1")
    _dcp_roundtrip(path, 1)
    _dcp_roundtrip(str(tmp_path / "other" / "step-1"), 2)
    os.rename(tmp_path / "other" / "step-1", tmp_path / layout.DCP_COMMIT.staging_dir("step-1"))
    recover_folder(path)
    assert sorted(os.listdir(tmp_path)) == ["other", "step-1"]
    out = {"w": torch.zeros(8, 4), "step": -1}
    dcp.load(out, storage_reader=StorageReader(path), no_dist=True)
    assert out["step"] == 1
