#!/usr/bin/env bash
# The main job on a fresh machine: set up the environment, then train, crash, resume and compare.
# Extra arguments go to scripts/main_job.py (e.g. --device xla runs it on the XLA CPU device).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lane=cpu
for a in "$@"; do [ "$a" = "xla" ] && lane=xla; done
py="$(bash "$root/scripts/setup_env.sh" "$lane" | tail -n 1)"
set +e
"$py" "$root/scripts/main_job.py" "$@"
rc=$?
set -e
bin="$(dirname "$py")"
echo "[main job] exit status $rc. The nxd-ckpt command is $bin/nxd-ckpt (not on your PATH: run it by that path," >&2
echo "[main job]   or: export PATH=\"$bin:\$PATH\"; or: source $bin/activate)" >&2
exit $rc
