"""The nxd_ckpt logger: one INFO line per save and load on the master with bytes, time, throughput and blocked
time; only warnings and errors from other ranks unless asked."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import nxd_ckpt as nxd
from nxd_ckpt.log import ALL_RANKS_ENV, format_bytes, format_rate, get_logger


@pytest.fixture
def records():
    """Records that reach a handler on the ``nxd_ckpt`` logger (after its filters), at INFO and above."""
    caught: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record)

    logger = get_logger()
    handler, old_level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield caught
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_one_line_per_save_and_load_with_bytes_time_throughput_blocked(tmp_path, records):
    model = torch.nn.Linear(256, 256)
    nxd.save_checkpoint(tmp_path, "step_1", model=model)
    nxd.load_checkpoint(tmp_path, model=model)
    lines = [r.getMessage() for r in records]
    saves = [m for m in lines if m.startswith("saved step_1")]
    loads = [m for m in lines if m.startswith("loaded step_1")]
    assert len(saves) == 1 and len(loads) == 1, lines
    size = format_bytes(sum(p.numel() * 4 for p in model.parameters()))
    assert size == "257 KiB"  # 256*256+256 floats: human-readable, not "0.3 MiB"
    for line in saves + loads:
        assert size in line and re.search(r"\d+(\.\d)? ([KMGT]i)?B/s", line) and "blocked" in line, line


def test_sizes_in_log_lines_are_readable_at_every_scale():
    """One convention, binary units, in logs and the command's output alike."""
    assert [format_bytes(n) for n in (0, 1023, 12_345, 99_949, 456e6, 4.6e9, 3 << 40)] == [
        "0 B",
        "1023 B",
        "12.1 KiB",
        "97.6 KiB",
        "435 MiB",
        "4.3 GiB",
        "3.0 TiB",
    ]
    assert format_rate(12_345, 0.01) == "1.2 MiB/s" and format_rate(1, 0) == "-"


def test_non_master_ranks_pass_only_warnings(monkeypatch, records):
    logger = get_logger()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(ALL_RANKS_ENV, raising=False)
    logger.info("info from rank 1")
    logger.warning("warning from rank 1")
    monkeypatch.setenv(ALL_RANKS_ENV, "1")
    logger.info("info from rank 1, all ranks asked for")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(ALL_RANKS_ENV)
    logger.info("info from rank 0")
    assert [r.getMessage() for r in records] == [
        "warning from rank 1",
        "info from rank 1, all ranks asked for",
        "info from rank 0",
    ]
