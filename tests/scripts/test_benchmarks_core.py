"""The benchmark core (load guard, report, timing helpers, child runner) and smoke runs of the suites at tiny
sizes (that they run and report, not their speed), and the wheel: it ships no benchmark module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.core import loadguard
from benchmarks.core.child import in_child
from benchmarks.core.report import Report, fmt_bytes
from benchmarks.core.timing import median, paired_median, rotated

pytestmark = pytest.mark.device_independent

REPO = Path(__file__).resolve().parents[2]


def test_the_load_guard_refuses_a_busy_machine_unless_told(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    with pytest.raises(loadguard.MachineBusy, match="load average is 1.50, above 1.*--ignore-load"):
        loadguard.check_load(override=False)
    assert loadguard.check_load(override=True) == {"load_start": 1.5, "load_override": True}
    assert "NOT results" in capsys.readouterr().err
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 1.0, 1.0))
    assert loadguard.check_load(override=False) == {"load_start": 0.4, "load_override": False}


def test_a_suite_does_not_start_on_a_busy_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 1.0, 1.0))
    with pytest.raises(SystemExit, match="above 1"):
        main(["coordinator", "--steps", "1", "--json", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


def test_the_report_writes_its_markdown_and_json(tmp_path, capsys):
    report = Report("demo", ["demo", "--x", "1"])
    report.say("first line")
    report.say("progress", err=True)
    report.table(["name", "s"], [["a", "1.00"]])
    report.data["figure"] = 1.5
    report.finish(str(tmp_path / "r.json"), str(tmp_path / "r.md"))
    markdown = (tmp_path / "r.md").read_text()
    assert "-m benchmarks demo --x 1" in markdown and "first line" in markdown and "| a | 1.00 |" in markdown
    assert "progress" not in markdown and "progress" in capsys.readouterr().err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["suite"] == "demo" and data["data"] == {"figure": 1.5} and "load_end" in data["meta"]
    assert data["markdown"][0] == "first line"


def test_timing_helpers():
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and rotated([], 3) == []
    assert median([3.0, None, 1.0, 2.0]) == 2.0 and median([None]) is None
    assert paired_median([2.0, 6.0, 3.0], [1.0, 2.0, 3.0]) == 2.0
    assert fmt_bytes(None) == "n/a" and fmt_bytes(2.5e9) == "2.500 GB" and fmt_bytes(3e5) == "0.3 MB"


def test_a_child_returns_its_result_and_a_failed_one_says_so():
    assert in_child("benchmarks.core.timing:median", {"values": [1.0, 5.0, 3.0]}) == 3.0
    with pytest.raises(RuntimeError, match=r"(?s)benchmarks.core.timing:median failed .exit 1.*TypeError"):
        in_child("benchmarks.core.timing:median", {"wrong": 1}, quiet=True)


def _smoke(argv: list[str], tmp_path: Path) -> dict:
    """Run a suite at a tiny size on whatever load there is; its JSON report."""
    out = tmp_path / "report.json"
    assert main([*argv, "--ignore-load", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_first_save_suite_smoke(tmp_path):
    data = _smoke(["first_save", "--mib", "4", "--tensors", "4", "--saves", "2", "--sections", "keep"], tmp_path)
    keep = data["data"]["keep"]
    assert len(keep["saves"]) == 2 and keep["ratio"] == pytest.approx(keep["first_s"] / keep["steady_s"])


def test_saveload_suite_smoke(tmp_path):
    argv = ["saveload", "--size-gb", "0.004", "--hidden", "32", "--reps", "1", "--sections",
            "raw_buffered,nxd_plain,nxd_xser_live", "--dir", str(tmp_path)]  # fmt: skip
    data = _smoke(argv, tmp_path)
    assert set(data["data"]["results"]) == {"raw_buffered", "nxd_plain", "nxd_xser_live"}
    assert any("resume: nxd_xser_live: peak extra host memory" in line for line in data["markdown"])


def test_coordinator_and_inspect_suites_smoke(tmp_path):
    data = _smoke(["coordinator", "--ranks", "2", "--steps", "2"], tmp_path)
    assert len(data["data"]["steps"]) == 5
    data = _smoke(["inspect", "--mib", "1", "--tensors", "4", "--dir", str(tmp_path / "i"), "--sections", "xser"],
                  tmp_path)  # fmt: skip
    assert set(data["data"]["xser"]) == {"manifest_s", "one_tensor_s", "full_load_s"}


@pytest.mark.skipif(shutil.which("sync") is None, reason="the suite syncs before each child")
def test_convert_zero1_memory_suite_smoke(tmp_path):
    argv = ["convert_zero1_memory", "--workdir", str(tmp_path), "--params", "2", "--rows", "8", "--cols", "16",
            "--sections", "xser"]  # fmt: skip
    rows = _smoke(argv, tmp_path)["data"]["rows"]
    assert [r["case"] for r in rows] == ["DP 4 -> 2", "DP 4 -> 3", "DP 4 -> full"]


def test_the_wheel_ships_no_benchmark_module(tmp_path):
    """Built from a copy of the package's sources with the benchmarks beside them, as in the repository."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("nxd_ckpt", "benchmarks", "scripts"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("nxd_ckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("nxd_ckpt/") for n in names)
    assert [n for n in names if n.split("/")[0] in ("benchmarks", "scripts", "tests")] == []
