"""A real-width MoE learns the default task by RL, bit-exact: true on-policy with routing replay (R3).

    PYTHONPATH=$PWD python3 bench/gpu_moe_learning.py --out DIR                  (one H200; ~5 minutes)
    PYTHONPATH=$PWD python3 bench/gpu_moe_learning.py --tiny --out DIR           (CPU: deepseek-v3-tiny)

The default task (configs/tiny.yaml: single-digit sums, "3+4=" -> "7", reward 1 for the right digit)
from a randomly initialised preset (deepseek-v3-small: DeepSeek-V3's layers at real widths; or
qwen3-moe-small). A random model of a 129280-row vocabulary almost never says a digit, so GRPO would see
no reward at all; a short format warm start fixes that without teaching a single sum: SFT on the train
prompts, each with every digit as its label once, so the model answers "a digit, then end-of-text" with
the digits spread evenly, and is right about one time in ten. Then GRPO (true on-policy, R3, colocated engine) from its export. What the
run shows: train reward per step rising from the format-only level, held-out pass@1 (data/arith/test.jsonl,
sums the training prompts do not hold) before and after, and trainer-engine logprob diff and routing
mismatch exactly 0 every step. Writes moe_learning.json and moe_learning.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_learning import copy_run, run_phase  # noqa: E402

from pipeline.observability.metrics import read_metrics  # noqa: E402
from pipeline.run import RunDir  # noqa: E402

SFT_CONFIG, RL_CONFIG = "configs/sft-tiny.yaml", "configs/tiny.yaml"
GPU_COMMON = ["model.dtype=bfloat16", "train.device=cuda", "train.recompute_activations=true", "logging.plot=false"]
GPU_SFT = [*GPU_COMMON, "train.lr=1e-4", "rollout.rollout_batch_size=32", "train.global_batch_size=32",
           "checkpoint.save_interval=0", "checkpoint.save_final=false"]
GPU_RL = [*GPU_COMMON, "train.lr=3e-5", "engine.device=cuda", "weights.type=tensor", "engine.colocated=true",
          "determinism.true_on_policy=true", "determinism.routing_replay=true", "checkpoint.save_final=false",
          "checkpoint.export_hf=false", "eval.interval=10"]
TINY_SFT = ["train.lr=3e-3", "checkpoint.save_interval=0", "checkpoint.save_final=false", "logging.plot=false"]
TINY_RL = ["determinism.true_on_policy=true", "determinism.routing_replay=true", "checkpoint.save_final=false",
           "checkpoint.export_hf=false", "eval.interval=10", "logging.plot=false"]
STEPS = {"gpu": (20, 40), "tiny": (20, 30)}  # (format SFT, RL)


def format_data(path: str, seed: int) -> int:
    """data/arith/train.jsonl's prompts, each once with every digit as its label (shuffled, seeded): the
    answer's form and no sum, and no one wrong digit per prompt to memorise either, so the warm start
    answers each prompt with a spread of digits and GRPO's groups disagree."""
    with open(os.path.join(REPO, "data", "arith", "train.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    rows = [{"prompt": p, "label": str(d)} for p in prompts for d in range(10)]
    random.Random(seed).shuffle(rows)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


def rl_results(run_dir: str) -> dict:
    records = read_metrics(run_dir) if os.path.isdir(run_dir) else []
    col = lambda key: [r.get(key) for r in records]  # noqa: E731
    evals = []
    rundir = RunDir(run_dir)
    if os.path.isdir(run_dir):
        for step in rundir.eval_steps():
            m = rundir.eval_step(step).summary()["metrics"]
            evals.append({"version": step, "pass@1": m.get("eval/test/pass@1"), "reward_mean": m.get("eval/test/reward_mean")})
    return {"steps": len(records), "reward": col("rollout/reward_mean"),
            "logprob_max_abs_diff": col("train/rollout_logprob_max_abs_diff"),
            "routing_mismatch_frac": col("train/routing_mismatch_frac"),
            "routing_live_mismatch_frac": col("train/routing_live_mismatch_frac"),
            "step_time_s": col("perf/step_time_s"),
            "trainer_peak_gib": max((r.get("perf/trainer_peak_memory_gib") or 0.0 for r in records), default=None),
            "engine_peak_gib": max((r.get("perf/engine_peak_memory_gib") or 0.0 for r in records), default=None),
            "eval": evals}


def verdict(rl: dict, rl_steps: int) -> dict:
    reward = [r for r in rl["reward"] if r is not None]
    k = max(1, len(reward) // 5)  # first and last fifth of the steps
    first, last = (sum(reward[:k]) / k, sum(reward[-k:]) / k) if reward else (None, None)
    diffs = [d for d in rl["logprob_max_abs_diff"] if d is not None]
    routing = [d for d in rl["routing_mismatch_frac"] if d is not None]
    return {"reward_first_fifth": first, "reward_last_fifth": last,
            "reward_rising": bool(reward) and last > first + 0.1,
            "all_steps": rl["steps"] == rl_steps,
            "logprob_diff_zero": len(diffs) == rl_steps and all(d == 0.0 for d in diffs),
            "routing_mismatch_zero": len(routing) == rl_steps and all(d == 0.0 for d in routing)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = results["rl"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(range(len(rl["reward"])), rl["reward"], color="tab:blue", label="train reward (mean per step)")
    ax.plot([e["version"] for e in rl["eval"]], [e["pass@1"] for e in rl["eval"]], "o-", color="tab:red",
            label="held-out pass@1 (data/arith/test.jsonl)")
    ax.axhline(0.1, color="gray", lw=0.8, ls=":", label="a random digit")
    ax.set(title=f"{results['preset']}: GRPO, true on-policy + R3 ({results['device']})", xlabel="step",
           ylabel="exact-match rate", ylim=(0, 1))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU: deepseek-v3-tiny, the checks only")
    p.add_argument("--preset", default=None, help="model.init preset (default deepseek-v3-small; deepseek-v3-tiny with --tiny)")
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--rl-steps", type=int, default=None)
    p.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="override of the SFT phase")
    p.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="override of the RL phase")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "bench", "results"))
    p.add_argument("--work", default=None)
    p.add_argument("--time-limit", type=float, default=570.0)
    a = p.parse_args()
    size = "tiny" if a.tiny else "gpu"
    preset = a.preset or ("deepseek-v3-tiny" if a.tiny else "deepseek-v3-small")
    sft_steps, rl_steps = a.sft_steps or STEPS[size][0], a.rl_steps or STEPS[size][1]
    work = a.work or tempfile.mkdtemp(prefix="lockstep-moe-learning-")
    os.makedirs(work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    remaining = lambda: a.time_limit - (time.time() - t_start)  # noqa: E731
    import torch

    device = "cpu" if a.tiny else torch.cuda.get_device_name(0)
    results = {"preset": preset, "device": device, "phases": []}
    data = os.path.join(work, "format.jsonl")
    results["format_rows"] = format_data(data, seed=0)
    sft_dir, rl_dir = os.path.join(work, "sft"), os.path.join(work, "rl")
    sft_over = [f"run_dir={sft_dir}", f"num_rollout={sft_steps}", f"model.init={preset}", f"data.prompt_data={data}",
                *(TINY_SFT if a.tiny else GPU_SFT), *a.sft]
    results["phases"].append(run_phase("sft", SFT_CONFIG, sft_over, remaining()))
    results["sft_loss"] = [r.get("train/sft_loss") for r in read_metrics(sft_dir)] if os.path.isdir(sft_dir) else []
    if results["phases"][-1]["rc"] == 0:
        rl_over = [f"run_dir={rl_dir}", f"num_rollout={rl_steps}", f"model.path={RunDir(sft_dir).hf_export}",
                   *(TINY_RL if a.tiny else GPU_RL), *a.rl]
        results["phases"].append(run_phase("rl", RL_CONFIG, rl_over, remaining()))
    results["rl"] = rl_results(rl_dir)
    for name, run_dir in (("sft", sft_dir), ("rl", rl_dir)):  # metrics, config, evals, logs: no weights
        if os.path.isdir(run_dir):
            copy_run(run_dir, os.path.join(a.out, "runs", name))
            logs = RunDir(run_dir).log_files()
            for path in logs:
                shutil.copy(path, os.path.join(a.out, "runs", name))
    results["verdict"] = verdict(results["rl"], rl_steps)
    with open(os.path.join(a.out, "moe_learning.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(a.out, "moe_learning.png"))
    for ph in results["phases"]:
        print(f"{ph['phase']:<4} {ph['wall_s']:>7.1f}s  rc {ph['rc']}" + (f"  {ph['error']}" if ph.get("error") else ""))
    rl, v = results["rl"], results["verdict"]
    print("reward per step   " + " ".join(f"{r:.2f}" for r in rl["reward"] if r is not None))
    print("held-out pass@1   " + " ".join(f"v{e['version']}:{e['pass@1']:.2f}" for e in rl["eval"] if e["pass@1"] is not None))
    print(f"verdict           {json.dumps(v)}")
    ok = all(ph["rc"] == 0 for ph in results["phases"]) and v["logprob_diff_zero"] and v["routing_mismatch_zero"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
