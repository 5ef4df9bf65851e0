"""The dcp suite runs end to end at a tiny size on 2 gloo ranks and reports every save path, load and target ratio
(not its speed); a section this machine cannot run is skipped with the reason."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.cli import main
from benchmarks.suites.dcp.tables import figure, ratio_line

pytestmark = pytest.mark.device_independent

SAVES = {"dcp_sync", "dcp_async", "dcp_stager", "tc_async", "nxd_async", "nxd_sync"}
LOADS = {"dcp_load", "nxd_load", "tc_load"}


def test_the_suite_lists_its_sections_and_skips_cuda_without_a_gpu(tmp_path, capsys):
    assert main(["dcp", "--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["cpu", "xla", "cuda"]
    if torch.cuda.is_available():
        return
    out = tmp_path / "report.json"
    assert main(["dcp", "--sections", "cuda", "--ignore-load", "--json", str(out)]) == 0
    assert "sees no CUDA device" in json.loads(out.read_text())["data"]["cuda"]["skipped"]


def test_a_tiny_cpu_run_reports_every_path_load_and_ratio(tmp_path):
    out = tmp_path / "report.json"
    argv = ["dcp", "--sections", "cpu", "--size-gb", "0.002", "--hidden", "32", "--reps", "1", "--warm",
            "--dir", str(tmp_path), "--ignore-load", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    cpu = report["data"]["cpu"]
    have_tc = importlib.util.find_spec("torch_checkpointing") is not None
    expected = SAVES | LOADS if have_tc else (SAVES | LOADS) - {"tc_async", "tc_load"}
    assert cpu["failed"] == {}
    assert set(cpu["labels"]) == expected and set(cpu["missing"]) == ({"tc_async"} - expected)
    [row] = cpu["rows"]
    assert set(row) == expected | {"baseline"}
    for key in expected & SAVES:
        assert 0 < row[key]["blocked_s"] <= row[key]["durable_s"], key
        assert cpu["peak_extra_bytes"][key] >= 0
    assert all(row[key] > 0 for key in expected & LOADS)
    assert cpu["checks"] == dict.fromkeys(expected & LOADS, "bit-exact")
    lines = "\n".join(report["markdown"])
    for ratio in ("CPU state blocked: nxd async_save / memcpy", "time to durable: nxd async_save / DCP's sync",
                  "CPU state blocked: nxd async_save / DCP async_save + DefaultStager",
                  "load speed: dcp.load's seconds / nxd StorageReader's"):  # fmt: skip
        assert f"| {ratio}" in lines and ("| MET |" in lines or "| NOT MET |" in lines)
    assert "sync_files=True" in lines
    assert cpu["ratios"]["CPU state blocked: nxd async_save / memcpy of the state"] == pytest.approx(
        row["nxd_async"]["blocked_s"] / row["baseline"]
    )
    assert cpu["ratios"]["CPU state blocked: nxd async_save / DCP async_save + DefaultStager"] == pytest.approx(
        row["nxd_async"]["blocked_s"] / row["dcp_stager"]["blocked_s"]
    )


def test_a_ratio_says_its_verdict_and_a_missing_figure_is_not_a_verdict():
    rows = [{"nxd_async": {"blocked_s": 2.0}, "baseline": 1.0}, {"nxd_async": {"blocked_s": 4.0}, "baseline": 1.0},
            {"nxd_async": None, "baseline": 3.0}]  # fmt: skip
    assert figure(rows, ("nxd_async", "blocked_s")) == 3.0 and figure(rows, ("baseline", None)) == 1.0
    assert ratio_line("r", 3.0, 1.0, "<=", 1.0).endswith("| 3.000x | <= 1x | NOT MET |")
    assert ratio_line("r", 3.0, 1.0, ">=", 1.0).endswith("| MET |")
    assert ratio_line("r", None, 1.0, "<=", 1.0) == "| r | n/a | <= 1x | |"
