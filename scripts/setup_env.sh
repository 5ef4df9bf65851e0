#!/usr/bin/env bash
# Create (or reuse) a virtual environment for one test lane and print its python path on the last line.
#   bash scripts/setup_env.sh [cpu|xla] [--fuse3]
# --fuse3 (the test command's): also install fuse3 for the power-loss suite; the main job does not need it.
# Quiet: pip's and apt-get's output goes to a log beside the environment ($NXD_CKPT_ENV_DIR/<lane>.setup.log),
# shown only when a step fails; stderr gets one [setup] line per step.
#   cpu: torch 2.13.0 (CPU build) + nxd_ckpt[test,s3,torchtitan] (the torchtitan extra needs Python >= 3.11; on 3.10
#        it installs nothing and tests/torchtitan skips)
#   xla: torch 2.9.0 + torch-xla 2.9.0 + nxd_ckpt[test,s3,frameworks] + optimum-neuron 0.4.2 (--no-deps: its own
#        requirements pin numpy<=1.26.4; tests/thirdparty runs its pinned sources over the package's other modules)
# Environments live outside the clone (NXD_CKPT_ENV_DIR, default ~/.cache/nxd-ckpt/envs) and are rebuilt only
# when pyproject.toml or this script changes, so repeated CI runs on one machine skip the set-up.
#
# Where torch comes from, first match wins (each step says what it does and how big it is):
#   1. the environment already has the pinned torch: kept (no download);
#   2. python3 itself has the pinned torch (e.g. a Deep Learning AMI): the venv sees it (--system-site-packages);
#   3. a local wheel pip can find without the network (pip's find-links): installed from there;
#   4. NXD_CKPT_TORCH_INDEX (default for the cpu lane: https://download.pytorch.org/whl/cpu, the CPU build,
#      ~190 MB download, ~0.75 GB installed); "pypi" uses PyPI, whose Linux torch is the CUDA build
#      (~0.9 GB torch + ~3.5 GB of NVIDIA packages, ~6 GB installed). The xla lane uses PyPI by default (the
#      combination the suite is tested with); NXD_CKPT_TORCH_INDEX=https://download.pytorch.org/whl/cpu tries the
#      CPU build there too.
# Needs: python3 >= 3.10 with the venv module (Debian/Ubuntu: apt-get install python3-venv), flock (util-linux).
set -euo pipefail
lane=cpu
fuse3=0
for arg in "$@"; do
  case "$arg" in
    --fuse3) fuse3=1 ;;
    -*) echo "setup_env.sh: unknown option '$arg' (expected --fuse3)" >&2; exit 2 ;;
    *) lane="$arg" ;;
  esac
done
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_dir="${NXD_CKPT_ENV_DIR:-$HOME/.cache/nxd-ckpt/envs}/$lane"
log="$env_dir.setup.log"
cpu_index="https://download.pytorch.org/whl/cpu"
case "$lane" in
  cpu) torch_version=2.13.0; extra_pins=(); extras="test,s3,torchtitan"; no_deps=(); default_index="$cpu_index"; installed_size="~1.8 GB" ;;
  xla) torch_version=2.9.0; extra_pins=(torch-xla==2.9.0); extras="test,s3,frameworks"; no_deps=(optimum-neuron==0.4.2)
       default_index=pypi; installed_size="~7.6 GB" ;;
  *) echo "setup_env.sh: unknown lane '$lane' (expected cpu or xla)" >&2; exit 2 ;;
esac
torch_index="${NXD_CKPT_TORCH_INDEX:-$default_index}"
say() { echo "[setup] $*" >&2; }

# Prerequisites, checked before anything is created.
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
  || { say "python3 >= 3.10 is required (found: $(python3 --version 2>&1 || echo none))"; exit 1; }
python3 -c 'import venv, ensurepip' 2>/dev/null \
  || { say "python3's venv module is missing: install it (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
command -v flock >/dev/null || { say "flock is required (package util-linux)"; exit 1; }

# Runs "$@" with its output appended to the log; on failure says which command failed and shows the log's end.
quietly() {
  local rc=0
  "$@" >>"$log" 2>&1 || rc=$?
  [ "$rc" = 0 ] && return 0
  say "failed (exit $rc): $*"
  say "its output, the end of $log:"
  tail -n 40 "$log" >&2
  return "$rc"
}

# The power-loss suite (tests/faults/test_power_loss.py) needs libfuse 3 and fusermount3 (Debian: fuse3): with
# --fuse3 (the test command), as root with /dev/fuse present, they are installed when missing; elsewhere that suite
# says why it is skipped. The main job never needs them.
install_fuse3() {
  [ -e /dev/fuse ] || return 0
  command -v fusermount3 >/dev/null && ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so' && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing fuse3 + libfuse3 (the power-loss tests' filesystem) ..."
    { quietly apt-get update -qq && quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-3; } \
      || say "could not install fuse3; the power-loss suite will fail with the reason"
  else
    say "fuse3/libfuse3 missing and not root: install them (apt-get install fuse3) for the power-loss suite"
  fi
}

stamp_src="$(cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)"
stamp_file="$env_dir/.nxd_ckpt_stamp"
# One builder at a time: concurrent runs (several developers, CI jobs) wait instead of pip-installing into one env.
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
if ! flock -n 9; then
  say "waiting for another run that is setting up the $lane environment ..."
  flock 9
fi
: >"$log"
[ "$fuse3" = 0 ] || install_fuse3

# Prints the torch version importable by python "$1" when it is the pinned one (any build: +cpu, +cu128 ...).
pinned_torch() {
  "$1" -c "import sys, torch; v = torch.__version__; sys.exit(0 if v.split('+')[0] == '$torch_version' else 1)" \
    2>/dev/null && "$1" -c "import torch; print(torch.__version__)"
}

install_torch() {
  local py="$env_dir/bin/python" have
  if have="$(pinned_torch "$py")"; then
    say "keeping torch $have already installed in $env_dir (no download)"
    return
  fi
  if "$py" -m pip install -q --no-deps --no-index "torch==$torch_version" >/dev/null 2>&1; then
    say "torch $torch_version installed from a local wheel (pip's find-links; no download)"
    return
  fi
  if [ "$torch_index" = pypi ]; then
    say "downloading torch $torch_version from PyPI: on Linux x86_64 this is the CUDA build, ~0.9 GB plus"
    say "  ~3.5 GB of NVIDIA packages (set NXD_CKPT_TORCH_INDEX=$cpu_index for the ~190 MB CPU build)"
    quietly "$py" -m pip install -q "torch==$torch_version"
  else
    say "downloading the torch $torch_version CPU build from $torch_index (~190 MB; NXD_CKPT_TORCH_INDEX=pypi for PyPI's)"
    if ! quietly "$py" -m pip install -q --no-deps --index-url "$torch_index" "torch==$torch_version"; then
      say "could not install torch $torch_version from $torch_index. Install a CPU build yourself, e.g."
      say "  $py -m pip install torch==$torch_version --index-url $cpu_index"
      say "or set NXD_CKPT_TORCH_INDEX=pypi to take PyPI's (CUDA) build, then run this again."
      exit 1
    fi
  fi
}

if [ -x "$env_dir/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_src" ]; then
  say "$lane environment up to date: $env_dir"
else
  if [ -x "$env_dir/bin/python" ]; then why="pyproject.toml or setup_env.sh changed since it was built"; else why="first run"; fi
  say "building the $lane environment in $env_dir ($why): torch==$torch_version ${extra_pins[*]:+${extra_pins[*]} }+ nxd_ckpt[$extras];"
  say "  $installed_size on disk with torch from $( [ "$torch_index" = pypi ] && echo "PyPI (CUDA build)" || echo "the CPU build" ), a few minutes"
  start=$(date +%s)
  venv_opts=()
  if [ ! -x "$env_dir/bin/python" ] && system_torch="$(pinned_torch python3)"; then
    say "python3 already has torch $system_torch: the environment uses it (--system-site-packages, no download)"
    venv_opts=(--system-site-packages)
  fi
  quietly python3 -m venv "${venv_opts[@]}" "$env_dir"
  quietly "$env_dir/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned, so nothing later can pull another (CUDA) build through a version range.
  install_torch
  say "installing nxd_ckpt[$extras] and its dependencies (pip's output: $log) ..."
  quietly "$env_dir/bin/python" -m pip install -q "torch==$torch_version" "${extra_pins[@]}" -e "$root[$extras]"
  if [ ${#no_deps[@]} -gt 0 ]; then quietly "$env_dir/bin/python" -m pip install -q --no-deps "${no_deps[@]}"; fi
  echo "$stamp_src" > "$stamp_file"
  say "$lane environment ready in $(( $(date +%s) - start )) s, $(du -sh "$env_dir" 2>/dev/null | cut -f1) on disk"
fi
# The package itself is installed editable; make sure this clone is the one on the path. Checked from / so that
# the working directory (often this clone) cannot stand in for an install pointing at another, maybe deleted, one:
# the nxd-ckpt console script does not run from the clone.
if ! (cd / && "$env_dir/bin/python" -c "import nxd_ckpt, os, sys; sys.exit(0 if os.path.realpath(nxd_ckpt.__path__[0]).startswith(os.path.realpath('$root')) else 1)") 2>/dev/null; then
  say "installing this clone ($root) into the $lane environment (editable) ..."
  quietly "$env_dir/bin/python" -m pip install -q --no-deps -e "$root"
fi
echo "$env_dir/bin/python"
