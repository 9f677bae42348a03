"""One GRPO step end to end: where its time goes (rollout / train / weight sync) and tokens/s per GPU.

    python bench/e2e_bench.py                  # GPU: configs/bench-0.5b.yaml (qwen3-0.5b, 256 x 512 tokens)
    python bench/e2e_bench.py --tiny           # CPU: configs/tiny.yaml, the default recipe
    python bench/e2e_bench.py --steps 4 rollout.rollout_max_response_len=1024    # overrides pass through

Runs the real job (`lockstep run`: engine process, trainer process, HDF5 buffer, weight sync) for
--steps steps, reads its metrics.jsonl and averages the steps after the first (which captures CUDA
graphs and warms the allocator). Prints a table, writes bench/results/e2e[_cpu].json with the
per-step records.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import write  # noqa: E402
from pipeline.observability.metrics import read_metrics  # noqa: E402
from pipeline.observability.report import step_split  # noqa: E402
from pipeline.run import RunDir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the CPU-sized default recipe instead of the 0.5B one")
    p.add_argument("--config", help="recipe to run (default: configs/bench-0.5b.yaml, or configs/tiny.yaml with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="steps to run (default 4 on the GPU, 12 with --tiny)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the job occupies (engine and trainer share one by default)")
    p.add_argument("--keep", help="run directory to keep (default: a temporary one)")
    args, overrides = p.parse_known_args()
    config = args.config or ("configs/tiny.yaml" if args.tiny else "configs/bench-0.5b.yaml")
    steps = args.steps or (12 if args.tiny else 4)
    if steps < 2:
        p.error("--steps must be >= 2: the first step is a warm-up and is not averaged")

    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, "bench")) as tmp:
        run_dir = args.keep or os.path.join(tmp, "run")
        cmd = [sys.executable, "-m", "pipeline.cli", "run", config, f"run_dir={run_dir}", f"num_rollout={steps}",
               "logging.plot=false", "checkpoint.export_hf=false", "--no-progress", *overrides]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode:
            sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
            for path in RunDir(run_dir).log_files():
                with open(path) as f:
                    sys.stderr.write(f"--- {os.path.basename(path)}\n" + "".join(f.readlines()[-25:]))
            sys.exit(res.returncode)
        records = read_metrics(run_dir)

    split = step_split(records, warmup=1)
    per_gpu = {k: split[k] / args.gpus for k in ("tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s")}
    print(f"{config}  {steps} steps ({split['steps']} averaged)  {args.gpus} GPU(s)  "
          f"{split['response_tokens']:.0f} response tokens per step")
    print(f"{'phase':<12} {'s/step':>8} {'share':>7} {'response tokens/s/GPU':>22}")
    print(f"{'step':<12} {split['step_s']:8.3f} {1:7.1%} {per_gpu['tokens_per_s']:22.0f}")
    print(f"{'rollout':<12} {split['rollout_s']:8.3f} {split['rollout_frac']:7.1%} {per_gpu['rollout_tokens_per_s']:22.0f}")
    print(f"{'train':<12} {split['train_s']:8.3f} {split['train_frac']:7.1%} {per_gpu['train_tokens_per_s']:22.0f}")
    print(f"{'weight sync':<12} {split['weight_sync_s']:8.3f} {split['weight_sync_frac']:7.1%} {'':>22}")
    rewards = " ".join(f"{r['rollout/reward_mean']:.3f}" for r in records)
    print(f"reward per step: {rewards}")
    write("e2e_cpu" if args.tiny else "e2e", {"config": config, "overrides": overrides, "gpus": args.gpus,
                                                "split": split, "per_gpu": per_gpu, "records": records})


if __name__ == "__main__":
    main()
