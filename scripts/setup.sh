#!/usr/bin/env bash
# Create .venv (Python 3.11) and install Lockstep into it. Idempotent: a second run installs nothing new.
#   scripts/setup.sh          runtime only (what `lockstep run` needs)
#   scripts/setup.sh test     plus the test dependencies (pytest, transformers, sglang's parser, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
stamp=".venv/.lockstep-installed${extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch==2.13.0 is pinned in pyproject.toml: the CPU build on local disk (an unpinned torch pulls CUDA).
  .venv/bin/python -m pip install --disable-pip-version-check -q -e ".${extra}" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import pipeline, torch, h5py" || { echo "setup failed" >&2; exit 1; }
  touch "$stamp"
fi
