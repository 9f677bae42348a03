#!/usr/bin/env bash
# Create .venv (Python 3.11) and install Lockstep into it. Idempotent: a second run installs nothing new.
#   scripts/setup.sh          runtime only (what `lockstep run` needs)
#   scripts/setup.sh test     plus the test dependencies (pytest, transformers, tensorboard, wandb, sglang's parser, ...)
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
if [ "${1:-}" = "test" ]; then
  contract=".venv/sglang-contract"
  if [ ! -f "$contract/.installed" ] || [ env/sglang-contract.txt -nt "$contract/.installed" ]; then
    rm -rf "$contract"
    .venv/bin/python -m pip install --disable-pip-version-check -q --no-deps --target "$contract" \
      -r env/sglang-contract.txt 2>&1 | grep -v "^WARNING" || true
    PYTHONPATH="$contract" .venv/bin/python -c "import sglang.srt.server_args, sglang_router.router_args" \
      || { echo "setup: SGLang's contract environment does not import (see env/sglang-contract.txt)" >&2; exit 1; }
    touch "$contract/.installed"
  fi
fi
