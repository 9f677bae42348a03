"""Step time of sync vs one_step_off vs fully_async on the tiny recipe, measured side by side (CPU).

    python bench/async_bench.py [--steps 40] [extra overrides...]   -> table + results/async_cpu.json

Each mode runs the same recipe for --steps steps in its own run directory; the step time is the wall
time between metrics records after a warm-up, so overlap of rollout and training shows directly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pipeline.observability.metrics import read_metrics  # noqa: E402


def run(mode: str, steps: int, extra: list[str], root: str) -> dict:
    run_dir = os.path.join(root, mode)
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "configs/tiny.yaml", f"run_dir={run_dir}", f"num_rollout={steps}",
           f"rollout.mode={mode}", "logging.plot=false", "checkpoint.export_hf=false", "--no-progress", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    records = read_metrics(run_dir)
    warm = records[5:]
    step = sum(r["perf/step_time_s"] for r in warm) / len(warm)
    return {"mode": mode, "step_time_s": step, "rollout_wait_s": sum(r["perf/rollout_time_s"] for r in warm) / len(warm),
            "train_s": sum(r["perf/train_time_s"] for r in warm) / len(warm),
            "reward_last3": sum(r["rollout/reward_mean"] for r in records[-3:]) / 3}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "bench")) as root:
        rows = [run(m, args.steps, extra, root) for m in ("sync", "one_step_off", "fully_async")]
    base = rows[0]["step_time_s"]
    print(f"{'mode':<14} {'step s':>7} {'speedup':>8} {'waiting for rollout s':>22} {'train s':>8} {'reward (last 3)':>16}")
    for r in rows:
        r["speedup_vs_sync"] = base / r["step_time_s"]
        print(f"{r['mode']:<14} {r['step_time_s']:7.3f} {r['speedup_vs_sync']:8.2f} {r['rollout_wait_s']:22.3f}"
              f" {r['train_s']:8.3f} {r['reward_last3']:16.3f}")
    out = os.path.join(REPO, "bench", "results", "async_cpu.json")
    with open(out, "w") as f:
        json.dump({"steps": args.steps, "extra": extra, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
