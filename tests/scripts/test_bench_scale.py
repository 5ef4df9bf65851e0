"""The scale suite runs end to end on a small world and its figures hang together (not its speed)."""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest

from benchmarks.cli import main
from benchmarks.suites.scale.store import store_release_s

pytestmark = pytest.mark.device_independent  # a simulation of many ranks, no device: runs once, in the CPU lane


def test_a_small_world_reports_every_figure_of_each_operation(tmp_path, capsys):
    out = tmp_path / "report.json"
    switch_interval = sys.getswitchinterval()
    with mock.patch.dict(os.environ):  # the suite sets its simulation's knobs in the environment
        assert main(["scale", "--ranks", "8", "--sections", "save,load,latest", "--dir", str(tmp_path),
                     "--json", str(out), "--ignore-load"]) == 0  # fmt: skip
    assert sys.getswitchinterval() == switch_interval
    report = json.loads(out.read_text())
    assert report["suite"] == "scale" and "load_start" in report["meta"]
    rows = {row["op"]: row for row in report["data"]["rows"]}
    assert set(rows) == {"first save", "save", "load", "latest"}
    save = rows["save"]
    assert save["files"] > 0 and save["requests"]["PUT"] == save["files"]
    assert 0 < save["store_ops_mean"] <= 30  # a constant per save, whatever the world (docs/scale.md)
    assert save["releases"] >= 2  # at least one world-wide step and the commit's outcome
    assert 0 <= save["critical_s"] <= save["coordination_s"]
    assert save["release_s"] > 0
    assert save["projected_s"] == pytest.approx(save["critical_s"] + save["releases"] * save["release_s"])
    assert save["parallel_s"] > 0 and save["parallel_projected_s"] == pytest.approx(
        save["parallel_s"] + save["releases"] * save["release_s"]
    )
    assert rows["latest"]["requests"].get("LIST", 0) <= 1
    printed = capsys.readouterr().out
    assert printed.count("\n") > 5 and "proj s" in printed  # every row printed as it was measured


def test_the_store_release_is_timed_with_real_waiting_connections():
    assert 0 < store_release_s(16, rounds=1) < 30


def test_the_dcp_rows_show_a_commit_whose_requests_do_not_grow_with_the_ranks(tmp_path, capsys):
    out = tmp_path / "report.json"
    with mock.patch.dict(os.environ):
        assert main(["scale", "--ranks", "4", "32", "--sections", "dcp", "--dir", str(tmp_path),
                     "--json", str(out), "--ignore-load"]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["data"]["rows"]
    saves = [r for r in rows if r["op"] == "dcp save"]
    plans = [r for r in rows if r["op"] == "dcp load planning"]
    assert [r["ranks"] for r in saves] == [4, 32] and [r["ranks"] for r in plans] == [4, 32]
    assert saves[0]["requests"] == saves[1]["requests"] and "GET" not in saves[0]["requests"]  # no manifest read
    assert saves[0]["prepare_requests"] == saves[1]["prepare_requests"]
    assert plans[0]["requests"] == plans[1]["requests"] == {"GET": 3}  # record, .metadata, index: no LIST
    assert saves[1]["index_bytes"] > saves[0]["index_bytes"] and saves[1]["coordinator_s"] > 0
    assert "dcp save" in capsys.readouterr().out
