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
# Two pytest workers (pytest-xdist): a test's processes keep about 1.3 of 2 cores busy, so a second
# worker fills the rest (a fixed 2, not -n auto: CI's 2 cores and 24 GiB are what it was measured on).
# Tests sharing the Slurm cluster or one whole run stay on one worker (tests/conftest.py). `-n 0` (or
# `-n 4` on a bigger machine) as an argument overrides it.
.venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
