#!/usr/bin/env bash
# The test suite: set up (with test dependencies), start a local Slurm cluster (slurm/local/cluster.sh:
# needs root for apt and the daemons; without it the Slurm tests are skipped), run pytest, stop Slurm.
# Extra arguments go to pytest (`scripts/test.sh -m "not slow"`: the fast tier). Exits non-zero when
# any test fails or none is collected (pytest exit 5).
# LOCKSTEP_NO_SLURM=1 skips the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
started=""
if [ -z "${LOCKSTEP_NO_SLURM:-}" ] && [ "$(id -u)" = 0 ]; then
  if slurm/local/cluster.sh start; then
    started=1
    export SLURM_CONF=${LOCKSTEP_SLURM_STATE:-/tmp/lockstep-slurm}/slurm.conf LOCKSTEP_REQUIRE_SLURM=1
  else
    echo "scripts/test.sh: the local Slurm cluster did not start; its tests will fail" >&2
    export LOCKSTEP_REQUIRE_SLURM=1
  fi
fi
cleanup() { [ -n "$started" ] && slurm/local/cluster.sh stop || true; }
trap cleanup EXIT
# Two pytest-xdist workers by default (one test's processes keep about 1.3 of 2 cores busy, so a second
# worker fills the rest: ~25 minutes instead of ~40 on 2 cores); tests sharing the Slurm cluster or one
# whole run stay on one worker (tests/conftest.py). Arguments naming the workers (-n N, -n0, -p no:xdist)
# replace the default.
workers=(-n 2 --dist loadgroup)
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses*|no:xdist) workers=() ;; esac
done
.venv/bin/python -m pytest ${workers[@]+"${workers[@]}"} "$@"
