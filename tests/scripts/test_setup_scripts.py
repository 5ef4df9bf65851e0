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


PACKAGE_LOG = "Collecting torch==2.13.0 (the package log)"
BANNER = "!! ****** setuptools' editable-install banner ****** !!"
APT_LOG = "Get:1 http://deb.example fuse3 (apt-get's log)"


def _fake_tools(tmp_path: Path) -> Path:
    """A folder for the front of PATH: ``apt-get`` (records its arguments in apt-get.calls and prints a package
    log), ``ldconfig`` (lists no libfuse3, so fuse3 counts as missing), and ``python3``: the real one, except that
    ``-m venv DIR`` makes a stub environment whose pip prints a package log and setuptools' banner (and fails when
    STUB_PIP_FAILS is set), whose torch is the pinned one, and whose python runs main_job.py as a one-line job."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    stub_python = tmp_path / "stub-venv-python"
    stub_python.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        f'  "-m pip "*) echo "{PACKAGE_LOG}"; echo "{BANNER}" >&2\n'
        '    if [ -n "${STUB_PIP_FAILS:-}" ]; then echo "ERROR: no matching distribution" >&2; exit 1; fi; exit 0 ;;\n'
        '  *"import nxd_ckpt"*) exit 1 ;;\n'
        '  *"print(torch"*) echo 2.13.0; exit 0 ;;\n'
        "  *torch*) exit 0 ;;\n"
        '  *main_job.py*) echo "MAIN JOB STARTS"; exit 0 ;;\n'
        "esac\nexit 0\n"
    )
    real_python = subprocess.run(
        ["python3", "-c", "import sys; print(sys.executable)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tools = {
        "apt-get": f'echo "$*" >> {tmp_path}/apt-get.calls\necho "{APT_LOG}"\nexit 0\n',
        "ldconfig": "exit 0\n",
        "python3": 'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        '  dir="${@: -1}"; mkdir -p "$dir/bin"; cp ' + f'{stub_python} "$dir/bin/python"; exit 0\nfi\n'
        f'exec {real_python} "$@"\n',
    }
    for name, body in [*tools.items(), ("stub-venv-python", None)]:
        path = bin_dir / name if body is not None else stub_python
        if body is not None:
            path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _with_fakes(bin_dir: Path, env_dir: Path, **extra: str) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "NXD_CKPT_ENV_DIR": str(env_dir), **extra}


def test_the_main_job_installs_no_fuse3_and_shows_no_package_log(tmp_path):
    """On a fresh machine the main job builds its environment with one [setup] line per step: no apt-get (fuse3
    is the test command's), pip's package log and setuptools' banner only in the log beside the environment."""
    bin_dir = _fake_tools(tmp_path)
    proc = _run("run_main_job.sh", env=_with_fakes(bin_dir, tmp_path / "envs"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.startswith("MAIN JOB STARTS")
    assert not (tmp_path / "apt-get.calls").exists(), "the main job ran apt-get"
    assert PACKAGE_LOG not in out and BANNER not in out and "fuse" not in out
    assert all(line.startswith(("[setup] ", "[main job] ")) for line in proc.stderr.splitlines()), proc.stderr
    assert "building the cpu environment" in proc.stderr
    log = (tmp_path / "envs" / "cpu.setup.log").read_text()
    assert PACKAGE_LOG in log and BANNER in log


def test_a_failed_install_shows_the_command_and_its_log(tmp_path):
    bin_dir = _fake_tools(tmp_path)
    proc = _run("run_main_job.sh", env=_with_fakes(bin_dir, tmp_path / "envs", STUB_PIP_FAILS="1"))
    assert proc.returncode != 0 and "MAIN JOB STARTS" not in proc.stdout
    assert "[setup] failed (exit 1): " in proc.stderr and "-m pip install -q --upgrade pip" in proc.stderr
    log = tmp_path / "envs" / "cpu.setup.log"
    assert f"[setup] its output, the end of {log}:" in proc.stderr
    assert "ERROR: no matching distribution" in proc.stderr and BANNER in proc.stderr


@pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="fuse3 is installed only as root with /dev/fuse"
)
def test_the_test_command_still_installs_fuse3_quietly(tmp_path):
    bin_dir = _fake_tools(tmp_path)
    _stub_env(tmp_path / "envs", "cpu", pytest_status=0)
    proc = _run("run_tests.sh", env=_with_fakes(bin_dir, tmp_path / "envs", NXD_CKPT_LANES="cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "apt-get.calls").read_text().splitlines()
    assert calls == ["update -qq", "install -y -qq fuse3 libfuse3-3"]
    assert "[setup] installing fuse3 + libfuse3" in proc.stderr and APT_LOG not in proc.stdout + proc.stderr
    proc = _run("setup_env.sh", "cpu", "--fuse4", env=_with_fakes(bin_dir, tmp_path / "envs"))
    assert proc.returncode == 2 and "unknown option '--fuse4' (expected --fuse3)" in proc.stderr
