"""knobs.py: every NXD_CKPT_* variable read in one place, one parsing rule per kind, clear errors."""

from __future__ import annotations

import os
import re

import pytest

from nxd_ckpt import knobs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", " On "])
def test_true_words(monkeypatch, raw):
    monkeypatch.setenv("NXD_CKPT_LOG_ALL_RANKS", raw)
    assert knobs.log_all_ranks() is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "off"])
def test_false_words(monkeypatch, raw):
    monkeypatch.setenv("NXD_CKPT_DIRECT_IO", raw)
    assert knobs.direct_io() is False


def test_unset_or_empty_is_the_default(monkeypatch):
    for name in knobs.KNOBS:
        monkeypatch.setenv(name, "  ")
    assert knobs.direct_io() is True and knobs.xla_transfer_thread() is True and knobs.log_all_ranks() is False
    assert knobs.io_threads() == 4 and knobs.xser_inline_bytes() == 64 << 10
    assert knobs.timeout_s() == 1800.0 and knobs.replica_reads() == "auto" and knobs.s3_endpoint_url() is None


@pytest.mark.parametrize(
    ("raw", "seconds"), [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25)]
)
def test_durations(monkeypatch, raw, seconds):
    monkeypatch.setenv("NXD_CKPT_TIMEOUT_S", raw)
    assert knobs.timeout_s() == seconds


def test_timeout_old_name_is_read_when_the_new_one_is_unset(monkeypatch):
    monkeypatch.delenv("NXD_CKPT_TIMEOUT_S", raising=False)
    monkeypatch.setenv("NXD_CKPT_COMMIT_TIMEOUT_S", "5m")
    assert knobs.timeout_s() == 300.0
    monkeypatch.setenv("NXD_CKPT_TIMEOUT_S", "20")
    assert knobs.timeout_s() == 20.0


@pytest.mark.parametrize(
    ("name", "raw", "read", "accepts"),
    [
        ("NXD_CKPT_DIRECT_IO", "maybe", knobs.direct_io, "1 or 0"),
        ("NXD_CKPT_IO_THREADS", "four", knobs.io_threads, "integer >= 1"),
        ("NXD_CKPT_IO_THREADS", "0", knobs.io_threads, "integer >= 1"),
        ("NXD_CKPT_XSER_INLINE_BYTES", "-1", knobs.xser_inline_bytes, "integer >= 0"),
        ("NXD_CKPT_TIMEOUT_S", "soon", knobs.timeout_s, "duration"),
        ("NXD_CKPT_TIMEOUT_S", "0", knobs.timeout_s, "duration > 0"),
        ("NXD_CKPT_REPLICA_READS", "gossip", knobs.replica_reads, "auto, broadcast"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, raw, read, accepts):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}={raw!r}.*{accepts}"):
        read()


def test_docs_table_matches():
    with open(os.path.join(REPO, "docs", "api.md")) as f:
        rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(NXD_CKPT_\w+)` \| ([^|]+) \|", f.read(), re.M)}
    assert set(rows) == set(knobs.KNOBS)
    for name, knob in knobs.KNOBS.items():
        default = {True: "1", False: "0", None: "(unset)"}.get(knob.default, knob.default)  # type: ignore[arg-type]
        if isinstance(default, float):
            default = f"{default:g}"
        assert rows[name].strip() == str(default), name


def test_no_other_module_reads_nxd_ckpt_variables():
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "nxd_ckpt")):
        if os.sep + "testing" in root:
            continue  # test harness variables (NXD_CKPT_TEST_*) are not knobs
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and name != "knobs.py":
                with open(path) as f:
                    text = f.read()
                if re.search(r"environ(\.get)?[\[(][^)\]]*NXD_CKPT_|getenv\([^)]*NXD_CKPT_", text) or re.search(
                    r"environ\.get\(\w+_ENV", text
                ):
                    offenders.append(os.path.relpath(path, REPO))
    assert not offenders


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2g", 2 << 30),
        ("64K", 64 << 10),
        ("1.5GB", 1_500_000_000),
        ("10 kB", 10_000),
        (" 1TiB ", 1 << 40),
    ],
)
def test_sizes(monkeypatch, raw, size):
    monkeypatch.setenv("NXD_CKPT_HOST_MEMORY_BUDGET", raw)
    assert knobs.host_memory_budget() == size


def test_host_memory_budget_unset_means_no_limit(monkeypatch):
    monkeypatch.delenv("NXD_CKPT_HOST_MEMORY_BUDGET", raising=False)
    assert knobs.host_memory_budget() is None


@pytest.mark.parametrize("raw", ["lots", "0", "0MiB", "-5MiB", "5iB", "5 MiBs"])
def test_bad_sizes_name_the_variable_and_the_form(monkeypatch, raw):
    monkeypatch.setenv("NXD_CKPT_HOST_MEMORY_BUDGET", raw)
    with pytest.raises(ValueError, match=r"NXD_CKPT_HOST_MEMORY_BUDGET=.*size > 0.*512MiB"):
        knobs.host_memory_budget()
