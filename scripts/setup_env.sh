#!/usr/bin/env bash
# Create (or reuse) a virtual environment for one test lane and print its python path on the last line.
#   cpu: torch 2.13 CPU build + nxd_ckpt[test,s3]        xla: torch 2.9.0 + torch-xla 2.9.0 + nxd_ckpt[test,s3]
# Environments live outside the clone (NXD_CKPT_ENV_DIR, default ~/.cache/nxd-ckpt/envs) and are rebuilt only
# when pyproject.toml or this script changes, so repeated CI runs on one machine skip the set-up.
set -euo pipefail
lane="${1:-cpu}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${NXD_CKPT_ENV_DIR:-$HOME/.cache/nxd-ckpt/envs}/$lane"
case "$lane" in
  cpu) torch_pins=(torch==2.13.0) ;;
  xla) torch_pins=(torch==2.9.0 torch-xla==2.9.0) ;;
  *) echo "setup_env.sh: unknown lane '$lane' (expected cpu or xla)" >&2; exit 2 ;;
esac
# The power-loss suite (tests/faults/test_power_loss.py) needs libfuse 3 and fusermount3 (Debian: fuse3). As root
# with /dev/fuse present they are installed here when missing; elsewhere that suite says why it is skipped.
if [ -e /dev/fuse ] && ! { command -v fusermount3 >/dev/null && ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so'; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing fuse3 + libfuse3 (power-loss test filesystem) ..." >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-3; } >&2 \
      || echo "[setup] could not install fuse3; the power-loss suite will fail with the reason" >&2
  else
    echo "[setup] fuse3/libfuse3 missing and not root: install them (apt-get install fuse3) for the power-loss suite" >&2
  fi
fi
stamp_src="$(cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
stamp_file="$env_dir/.nxd_ckpt_stamp"
# One builder at a time: concurrent runs (several developers, CI jobs) wait instead of pip-installing into one env.
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
if ! flock -n 9; then
  echo "[setup] waiting for another run that is setting up the $lane environment ..." >&2
  flock 9
fi
if [ -x "$env_dir/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_src" ]; then
  echo "[setup] $lane environment up to date: $env_dir" >&2
else
  if [ -x "$env_dir/bin/python" ]; then why="pyproject.toml or setup_env.sh changed since it was built"; else why="first run"; fi
  echo "[setup] building the $lane environment in $env_dir ($why): ${torch_pins[*]} + nxd_ckpt[test,s3] ..." >&2
  if [ "$lane" = xla ]; then
    echo "[setup] (a fresh xla environment downloads ~7 GB: torch 2.9.0 from PyPI is the CUDA build)" >&2
  fi
  start=$(date +%s)
  python3 -m venv "$env_dir"
  "$env_dir/bin/python" -m pip install -q --upgrade pip >&2
  # torch first and pinned, so nothing later can pull another (CUDA) build through a version range.
  "$env_dir/bin/python" -m pip install -q "${torch_pins[@]}" >&2
  "$env_dir/bin/python" -m pip install -q "${torch_pins[@]}" -e "$root[test,s3]" >&2
  echo "$stamp_src" > "$stamp_file"
  echo "[setup] $lane environment ready in $(( $(date +%s) - start )) s" >&2
fi
# The package itself is installed editable; make sure this clone is the one on the path.
if ! "$env_dir/bin/python" -c "import nxd_ckpt, os, sys; sys.exit(0 if os.path.realpath(nxd_ckpt.__path__[0]).startswith(os.path.realpath('$root')) else 1)" 2>/dev/null; then
  "$env_dir/bin/python" -m pip install -q --no-deps -e "$root" >&2
fi
echo "$env_dir/bin/python"
