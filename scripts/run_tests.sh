#!/usr/bin/env bash
# The test command: lint, then the suite on plain CPU (torch 2.13), then again on the XLA CPU device
# (torch 2.9.0 + torch-xla 2.9.0, PJRT_DEVICE=CPU, NXD_CKPT_TEST_DEVICE=xla: training state on the XLA device).
# Environments are built on first use and cached (~/.cache/nxd-ckpt/envs): cpu ~1.3 GB, xla ~7.5 GB (PyPI's torch
# 2.9.0 is the CUDA build), the XLA one in the background while the cpu lane runs. See scripts/setup_env.sh.
# pytest removes the temporary directories of passing tests at the end (pyproject: tmp_path_retention_policy).
# Set NXD_CKPT_LANES="cpu" or "xla" to run one lane; extra arguments go to pytest. Suites marked
# device_independent (file-protocol and storage fault injection: no state on a device) run in the CPU lane only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
lanes="${NXD_CKPT_LANES:-cpu xla}"
status=0
bins=()
setup_dir="$(mktemp -d)"
trap 'rm -rf "$setup_dir"' EXIT
xla_setup_pid=""
for lane in $lanes; do
  echo "================ lane: $lane ================"
  if [ "$lane" = xla ] && [ -n "$xla_setup_pid" ]; then
    echo "[xla] waiting for the XLA environment, built in the background during the cpu lane ..."
    xla_setup_rc=0
    wait "$xla_setup_pid" || xla_setup_rc=$?
    cat "$setup_dir/xla.err" >&2
    [ "$xla_setup_rc" -eq 0 ] || { echo "[xla] setting up the environment failed ($xla_setup_rc)" >&2; exit 1; }
    py="$(tail -n 1 "$setup_dir/xla.out")"
  else
    # --fuse3: the power-loss suite's filesystem (device_independent: it runs in the cpu lane only)
    py="$(bash scripts/setup_env.sh "$lane" $([ "$lane" = cpu ] && echo --fuse3) | tail -n 1)"
  fi
  if [ "$lane" = cpu ] && [[ " $lanes " == *" xla "* ]]; then
    # the XLA environment (a ~3 GB download on a fresh machine) builds while the cpu lane runs
    bash scripts/setup_env.sh xla >"$setup_dir/xla.out" 2>"$setup_dir/xla.err" &
    xla_setup_pid=$!
  fi
  if [ "$lane" = cpu ]; then
    echo "[lint] ruff check + ruff format --check"
    "$py" -m ruff check nxd_ckpt harness benchmarks tests scripts
    "$py" -m ruff format --check nxd_ckpt harness benchmarks tests scripts
  fi
  if [ "$lane" = xla ]; then
    # Model/optimizer state of the shared fixtures (testing.fakes.make_training) lives on the XLA CPU device;
    # every spawned rank gets its own xla:0. Cross-rank exchange stays on gloo with CPU objects.
    lane_env=(PJRT_DEVICE=CPU NXD_CKPT_TEST_LANE=xla NXD_CKPT_TEST_DEVICE=xla)
  else
    lane_env=(NXD_CKPT_TEST_LANE=cpu NXD_CKPT_TEST_DEVICE=cpu)
  fi
  env "${lane_env[@]}" "$py" -c "import sys, torch; xla = sys.argv[1] == 'xla' and __import__('torch_xla'); print('[$lane] python', sys.version.split()[0], '| torch', torch.__version__, '| torch_xla', xla.__version__ if xla else '-', flush=True)" "$lane"
  echo "[$lane] env: ${lane_env[*]}"
  set +e
  # --durations: the slowest tests of each lane in the log, to keep the whole run within CI's budget
  env "${lane_env[@]}" "$py" -m pytest -p no:cacheprovider --durations=15 "$@"
  rc=$?
  set -e
  # pytest exit code 5 means no tests were collected: that is a failure here, never a silent pass.
  if [ "$rc" -eq 5 ]; then echo "[$lane] pytest collected no tests: failing" >&2; rc=1; fi
  echo "[$lane] pytest exit code $rc"
  [ "$rc" -eq 0 ] || status=1
  bins+=("$(dirname "$py")")
done
echo "[tests] overall: $([ $status -eq 0 ] && echo passed || echo FAILED). The nxd-ckpt command: ${bins[0]}/nxd-ckpt" \
  "(not on your PATH: export PATH=\"${bins[0]}:\$PATH\")" >&2
exit $status
