#!/usr/bin/env bash
# The test suite: set up (with test dependencies), then pytest. Extra arguments go to pytest.
# Exits non-zero when any test fails or when no test is collected (pytest exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
