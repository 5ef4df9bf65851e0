"""The README's two commands: prerequisites checked up front, pytest's "no tests" is a failure, the CI entry
point is the README's test command, and the nxd-ckpt location is printed. Uses stub environments: nothing is
downloaded or installed."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the set-up scripts target Linux"),
    pytest.mark.device_independent,
]


def _stub_env(env_root: Path, lane: str, pytest_status: int) -> Path:
    """An environment setup_env.sh considers up to date, whose python runs nothing: ruff passes, pytest exits
    with ``pytest_status``, and the editable-install check says this clone is installed."""
    env = env_root / lane
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = pytest ]; then echo "stub pytest"; exit ' + str(pytest_status) + "; fi\n"
        "exit 0\n"
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "scripts/setup_env.sh").read_bytes())
    (env / ".nxd_ckpt_stamp").write_text(stamp.hexdigest()[:16] + "\n")
    return python


def _run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=REPO,
    )


def test_run_tests_fails_when_pytest_collects_nothing_and_says_where_nxd_ckpt_is(tmp_path):
    _stub_env(tmp_path / "empty", "cpu", pytest_status=5)
    proc = _run("run_tests.sh", env={"NXD_CKPT_ENV_DIR": str(tmp_path / "empty"), "NXD_CKPT_LANES": "cpu"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "collected no tests: failing" in proc.stderr

    python = _stub_env(tmp_path / "ok", "cpu", pytest_status=0)
    proc = _run("run_tests.sh", env={"NXD_CKPT_ENV_DIR": str(tmp_path / "ok"), "NXD_CKPT_LANES": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu environment up to date" in proc.stderr
    assert f"The nxd-ckpt command: {python.parent}/nxd-ckpt" in proc.stderr


def test_setup_checks_prerequisites_before_creating_anything(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    old_python = fake_bin / "python3"
    old_python.write_text(
        '#!/usr/bin/env bash\nif [ "$1" = --version ]; then echo "Python 3.9.18"; exit 0; fi\nexit 1\n'
    )
    old_python.chmod(0o755)
    env_dir = tmp_path / "envs"
    proc = _run(
        "setup_env.sh", "cpu", env={"PATH": f"{fake_bin}:{os.environ['PATH']}", "NXD_CKPT_ENV_DIR": str(env_dir)}
    )
    assert proc.returncode == 1
    assert "python3 >= 3.10 is required (found: Python 3.9.18)" in proc.stderr
    assert not env_dir.exists()

    proc = _run("setup_env.sh", "gpu", env={"NXD_CKPT_ENV_DIR": str(env_dir)})
    assert proc.returncode == 2 and "unknown lane 'gpu'" in proc.stderr


def test_ci_runs_the_readme_test_command_and_the_readme_install_lines_are_real():
    readme = (REPO / "README.md").read_text()
    assert "    bash scripts/run_tests.sh\n" in readme and "    bash scripts/run_main_job.sh\n" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec bash scripts/run_tests.sh\n" in ci
    # nxd-ckpt is not on PyPI: every install line installs from the clone or a built wheel.
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            if "pip install" in line and "nxd-ckpt" in line.split("pip install", 1)[1].split("#")[0]:
                pytest.fail(f"{doc.name}: installs nxd-ckpt from PyPI, where it does not exist: {line.strip()}")


def test_pyproject_license_is_an_spdx_string():
    """A TOML-table license makes setuptools print three deprecation warnings on every install."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in meta["build-system"]["requires"])
    # Test runs do not leave their checkpoints behind ($TMPDIR/pytest-of-$USER held ~230 MB per run).
    assert meta["tool"]["pytest"]["ini_options"]["tmp_path_retention_policy"] == "failed"


def _main_job_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("main_job", REPO / "scripts" / "main_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_recognises_its_planned_crash_and_names_its_files_honestly(tmp_path, monkeypatch):
    import torch

    import nxd_ckpt as nxd

    main_job = _main_job_module()
    torchrun_report = "E1123 api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 1091)\nChildFailedError"
    assert main_job.killed_by_sigkill(torchrun_report)
    assert not main_job.killed_by_sigkill("failed (exitcode: 1) local_rank: 0\nValueError: boom")

    small = {"w": torch.zeros(4, 4)}  # 64 bytes: inline in the xser reference file
    nxd.save_checkpoint(tmp_path, "small", model=small, use_xser=True)
    assert "all single torch.save-readable files: xser was asked for" in main_job.describe_files(str(tmp_path), "small")
    monkeypatch.setenv("NXD_CKPT_XSER_INLINE_BYTES", "0")
    nxd.save_checkpoint(tmp_path, "split", model=small, use_xser=True)
    assert "1 of them xser (one file per tensor)" in main_job.describe_files(str(tmp_path), "split")
