#!/usr/bin/env bash
# The test command: lint, then the suite on plain CPU (torch 2.13), then again on the XLA CPU device
# (torch 2.9.0 + torch-xla 2.9.0, PJRT_DEVICE=CPU). Environments are built on first use and cached.
# Set NXD_CKPT_LANES="cpu" or "xla" to run one lane; extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
lanes="${NXD_CKPT_LANES:-cpu xla}"
status=0
for lane in $lanes; do
  echo "================ lane: $lane ================"
  py="$(bash scripts/setup_env.sh "$lane" | tail -n 1)"
  if [ "$lane" = cpu ]; then
    echo "[lint] ruff check + ruff format --check"
    "$py" -m ruff check nxd_ckpt tests scripts
    "$py" -m ruff format --check nxd_ckpt tests scripts
  fi
  set +e
  if [ "$lane" = xla ]; then
    PJRT_DEVICE=CPU NXD_CKPT_TEST_LANE=xla "$py" -m pytest -p no:cacheprovider "$@"
  else
    NXD_CKPT_TEST_LANE=cpu "$py" -m pytest -p no:cacheprovider "$@"
  fi
  rc=$?
  set -e
  # pytest exit code 5 means no tests were collected: that is a failure here, never a silent pass.
  if [ "$rc" -eq 5 ]; then echo "[$lane] pytest collected no tests: failing" >&2; rc=1; fi
  echo "[$lane] pytest exit code $rc"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
