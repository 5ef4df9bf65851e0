"""The command and ``nxd_ckpt.dcp.describe`` / ``verify`` on a directory of DCP checkpoints in TorchTitan's layout
(``step-N`` folders): ours (with manifests) are listed, inspected, verified by checksum and pruned; a stock DCP
folder is verified by size, and the command says the contents were not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nxd_ckpt.dcp
from nxd_ckpt.cli import main

pytestmark = pytest.mark.device_independent  # host files only: runs once, in the CPU lane


def _save(folder: Path, step: int, *, stock: bool = False) -> None:
    state = {"model": {"w": torch.full((64, 8), float(step))}, "train_state": {"step": step}}
    writer = dcp.FileSystemWriter(folder) if stock else nxd_ckpt.dcp.StorageWriter(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)


@pytest.fixture
def titan_dir(tmp_path) -> Path:
    """step-1..3 by our writer, step-10 by stock DCP, step-11 a stock save that never finished (no .metadata)."""
    for step in (1, 2, 3):
        _save(tmp_path / f"step-{step}", step)
    _save(tmp_path / "step-10", 10, stock=True)
    (tmp_path / "step-11").mkdir()
    (tmp_path / "step-11" / "__0_0.distcp").write_bytes(b"partial")
    return tmp_path


def _cli(capsys, *args: str, check: int = 0) -> tuple[str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    assert status == check, f"exit {status}\nstdout:\n{out}\nstderr:\n{err}"
    return out, err


def test_list_shows_the_folders_in_step_order(titan_dir, capsys):
    out, _ = _cli(capsys, "list", str(titan_dir), "--json")
    doc = json.loads(out)
    assert doc["format"] == "dcp" and doc["latest"] == "step-10"
    assert [(t["tag"], t["complete"], t["checksums"]) for t in doc["tags"]] == [
        ("step-1", True, True), ("step-2", True, True), ("step-3", True, True), ("step-10", True, False),
        ("step-11", False, False),
    ]  # fmt: skip
    out, _ = _cli(capsys, "list", str(titan_dir))
    assert "step-10  dcp     complete, latest" in out and "none (stock DCP)" in out


def test_inspect_shows_the_entries_of_metadata(titan_dir, capsys):
    out, _ = _cli(capsys, "inspect", str(titan_dir), "--tag", "step-2", "--json")
    doc = json.loads(out)
    entries = {e["fqn"]: e for e in doc["entries"]}
    assert entries["model.w"]["shape"] == [64, 8] and entries["model.w"]["dtype"] == "float32"
    assert entries["train_state.step"]["kind"] == "bytes" and doc["manifests"] == 1
    assert {f["path"] for f in doc["files"]} >= {".metadata", "__0_0.distcp", "nxd_ckpt/manifest_rank_00000.json"}


def test_verify_checks_ours_by_checksum_and_names_a_damaged_file(titan_dir, capsys):
    out, _ = _cli(capsys, "verify", str(titan_dir), "--tag", "step-2")
    assert out.startswith("step-2: OK: 2 files checked by checksums from 1 manifests")
    damaged = titan_dir / "step-2" / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[-300] ^= 0x01  # inside the tensor's bytes: torch.load would not notice
    damaged.write_bytes(bytes(data))
    out, err = _cli(capsys, "verify", str(titan_dir), "--tag", "step-2", check=1)
    assert f"{damaged} is corrupt" in err and "FAILED" in out
    report = nxd_ckpt.dcp.verify(titan_dir / "step-2")
    assert not report.ok and str(damaged) in report.problems[0]


def test_verify_checks_a_stock_folder_by_size_and_says_so(titan_dir, capsys):
    out, err = _cli(capsys, "verify", str(titan_dir), "--tag", "step-10")
    assert "step-10: OK" in out and "sizes only, no checksums" in out
    assert "the contents could not be verified" in err
    distcp = titan_dir / "step-10" / "__0_0.distcp"
    os.truncate(distcp, distcp.stat().st_size - 10)
    _, err = _cli(capsys, "verify", str(titan_dir), "--tag", "step-10", check=1)
    assert f"{distcp} is truncated" in err


def test_verify_all_and_an_unfinished_folder(titan_dir, capsys):
    out, _ = _cli(capsys, "verify", str(titan_dir), "--all")
    assert [line.split(":")[0] for line in out.splitlines()] == ["step-1", "step-2", "step-3", "step-10"]
    _, err = _cli(capsys, "verify", str(titan_dir), "--tag", "step-11", check=1)
    assert "has no .metadata" in err


def test_prune_keeps_the_newest_complete_folders_and_newer_unfinished_ones(titan_dir, capsys):
    out, _ = _cli(capsys, "prune", str(titan_dir), "--keep", "2", "--dry-run")
    assert out.split() == ["would", "delete", "step-1", "would", "delete", "step-2"]
    assert (titan_dir / "step-1").exists()
    _cli(capsys, "prune", str(titan_dir), "--keep", "2")
    assert sorted(os.listdir(titan_dir)) == ["step-10", "step-11", "step-3"]
    restored = {"model": {"w": torch.zeros(64, 8)}, "train_state": {"step": -1}}
    dcp.load(restored, storage_reader=dcp.FileSystemReader(titan_dir / "step-3"))
    assert restored["train_state"]["step"] == 3


def test_list_of_a_dcp_directory_does_not_import_torch(titan_dir):
    code = (
        "import sys\nfrom nxd_ckpt.cli import main\nassert main(sys.argv[1:]) == 0\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(nxd_ckpt.__file__).parent.parent)}
    proc = subprocess.run([sys.executable, "-c", code, "list", str(titan_dir)], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("TORCH_NOT_IMPORTED"), proc.stdout[-300:]
