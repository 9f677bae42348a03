#!/usr/bin/env bash
# The main job: set up, then run the default tiny GRPO recipe on this machine. Extra arguments are
# config overrides, e.g.  scripts/demo.sh num_rollout=20 run_dir=runs/mine
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lockstep run configs/tiny.yaml "$@"
