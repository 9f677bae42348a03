"""A GPU recipe that learns, end to end: SFT warm start, then true on-policy GRPO from its export, on the
multidigit task (issue 23's goal: held-out pass@1 up >= 20 points from the SFT checkpoint to the end of
RL, trainer-engine logprob difference exactly 0 every step, all of it in under 10 minutes on one H200).

    python bench/gpu_learning.py                     # one H200: configs/multidigit-{sft,grpo}.yaml
    python bench/gpu_learning.py --tiny              # CPU: tiny-dense, 1-2 digit problems, a few steps
    python bench/gpu_learning.py --sft-steps 120 --rl-steps 250 --rl train.lr=3e-6   # calibrate

Phases, each the real job (`lockstep run`): data (`lockstep data make-multidigit`'s generator, seeded),
SFT (trainer only; run_dir/hf is its export), RL (engine + trainer + rollout manager from that export,
evaluating data/test.jsonl at version 0, every eval.interval versions, and the final weights). Writes
gpu_learning.json after every phase (a cut-off run keeps what ran) and gpu_learning.png (SFT loss; train
reward per step and held-out pass@1 per evaluation) to --out: $OUT when set, else bench/results/h200/
(bench/results/cpu/ with --tiny); the runs' metrics.jsonl and eval/ files go beside them under runs/.

Held-out pass@1 is read from each evaluation's summary.json and recomputed here from its per-sample
file (per prompt: the share of samples with reward >= 1, averaged; with the rewards themselves
recomputed from the response text by the task's reward function): the JSON holds both, and the goal
uses the recomputed one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pipeline.observability.metrics import read_metrics  # noqa: E402
from pipeline.observability.startup import read_startup, time_to_first_step  # noqa: E402
from pipeline.run import RunDir  # noqa: E402

SFT_CONFIG = "configs/multidigit-sft.yaml"
RL_CONFIG = "configs/multidigit-grpo.yaml"
EVAL_SET = "test"
GOAL_POINTS = 20.0  # held-out pass@1, SFT checkpoint (RL version 0) -> end of RL
GOAL_WALL_S = 600.0  # data + SFT + RL, each command's start to its end

# The data each size generates (pipeline.rollout.tasks.multidigit_splits' arguments).
DATA = {"gpu": dict(n_sft=20000, n_train=20000, n_test_per_digits=64, sft_max_digits=4, max_digits=4),
        "tiny": dict(n_sft=1500, n_train=1500, n_test_per_digits=16, sft_max_digits=2, max_digits=2)}
# --tiny: the same two configs on CPU with the 0.1M model, short responses (2-digit problems) and few steps.
TINY_COMMON = ["train.device=cpu", "model.dtype=float32", "train.max_tokens_per_gpu=4096", "logging.plot=false"]
TINY_SFT = [*TINY_COMMON, "model.init=tiny-dense", "rollout.rollout_batch_size=32", "train.global_batch_size=32",
            "rollout.rollout_max_response_len=32", "train.lr=3e-3", "train.lr_warmup_steps=0", "train.min_lr=3e-4"]
TINY_RL = [*TINY_COMMON, "engine.device=cpu", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
           "train.global_batch_size=32", "rollout.rollout_max_response_len=32", "engine.max_running_requests=64",
           "eval.interval=2", "eval.n_samples_per_prompt=2", "train.lr=1e-3", "train.lr_warmup_steps=0"]
STEPS = {"gpu": (90, 400), "tiny": (30, 4)}  # (SFT, RL)


def run_phase(name: str, config: str, overrides: list[str], timeout_s: float) -> dict:
    """`lockstep run config overrides` as a subprocess: its command, exit status, wall time, error line."""
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, *overrides, "--no-progress"]
    out = {"phase": name, "command": f"lockstep run {config} " + " ".join(overrides)}
    print(f"== {name}: {out['command']}", flush=True)
    t0 = time.time()
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
        out["rc"], err = res.returncode, res.stderr
        print(res.stdout, flush=True)
    except subprocess.TimeoutExpired as e:
        out["rc"] = None
        err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "")
        err += f"\nlockstep: error: the {name} phase ran past its {timeout_s:.0f}s limit"
    out["wall_s"] = round(time.time() - t0, 2)
    if out["rc"] != 0:
        lines = err.strip().splitlines() or ["(no output)"]
        out["error"] = next((line for line in reversed(lines) if line.startswith("lockstep: error:")), lines[-1])
        out["stderr_tail"] = lines[-25:]  # the failed component's last log lines follow the error line
        print(f"{name} failed:\n" + "\n".join(out["stderr_tail"]), file=sys.stderr, flush=True)
    return out


def timing(run_dir: str, records: list[dict]) -> dict:
    """Start-up (command start to the first step) and the sum of step times, from the run's own files."""
    return {"startup_s": time_to_first_step(read_startup(run_dir)),
            "steps_time_s": sum(r.get("perf/step_time_s") or 0.0 for r in records),
            "step_time_s_mean": (sum(r.get("perf/step_time_s") or 0.0 for r in records[1:]) / (len(records) - 1)
                                 if len(records) > 1 else None)}


def sft_results(run_dir: str) -> dict:
    records = read_metrics(run_dir) if os.path.isdir(run_dir) else []
    return {"steps": len(records), "loss": [r.get("train/sft_loss") for r in records],
            "trainer_peak_gib": max((r.get("perf/trainer_peak_memory_gib") or 0.0 for r in records), default=None),
            "epochs": records[-1].get("data/epoch") if records else None, **timing(run_dir, records)}


def recompute_pass1(samples_path: str, rm_type: str) -> dict:
    """pass@1 of one evaluation from its per-sample file, independently of the pipeline's summary: every
    reward recomputed from the response text; per prompt the share of correct samples; averaged."""
    from pipeline.rollout.rewards import resolve_reward

    fn = resolve_reward(rm_type)
    by_prompt: dict[int, list[float]] = {}
    digits: dict[int, int] = {}
    mismatched = 0
    with open(samples_path) as f:
        for line in f:
            s = json.loads(line)
            r = float(fn(s["response"], s["label"], {}))
            mismatched += r != s["reward"]
            by_prompt.setdefault(s["prompt_idx"], []).append(1.0 if r >= 1.0 else 0.0)
            digits[s["prompt_idx"]] = len(re.match(r"\d*", s["prompt"]).group())  # the first operand's length
    per_prompt = {i: sum(v) / len(v) for i, v in by_prompt.items()}
    by_digits: dict[int, list[float]] = {}
    for i, p in per_prompt.items():
        by_digits.setdefault(digits[i], []).append(p)
    return {"pass@1": sum(per_prompt.values()) / len(per_prompt), "num_prompts": len(per_prompt),
            "num_samples": sum(len(v) for v in by_prompt.values()), "reward_mismatches": mismatched,
            "pass@1_by_digits": {str(d): sum(v) / len(v) for d, v in sorted(by_digits.items())}}


def evaluations(run_dir: str, rm_type: str) -> list[dict]:
    """One entry per completed evaluation (weights version ascending): the pipeline's metrics and ours."""
    rundir, out = RunDir(run_dir), []
    for step in rundir.eval_steps():
        ev = rundir.eval_step(step)
        m = ev.summary()["metrics"]
        mine = recompute_pass1(ev.samples(EVAL_SET), rm_type)
        out.append({"version": step, "pass@1": m[f"eval/{EVAL_SET}/pass@1"], "pass@1_recomputed": mine["pass@1"],
                    "pass@1_by_digits": mine["pass@1_by_digits"],
                    "reward_mismatches": mine["reward_mismatches"], "num_prompts": mine["num_prompts"],
                    "num_samples": mine["num_samples"],
                    **{k.split("/")[-1]: v for k, v in m.items() if k.startswith(f"eval/{EVAL_SET}/pass@")
                       and k != f"eval/{EVAL_SET}/pass@1"},
                    "response_len_mean": m.get(f"eval/{EVAL_SET}/response_len_mean"),
                    "truncated_frac": m.get(f"eval/{EVAL_SET}/truncated_frac"), "time_s": m.get("eval/time_s")})
    return out


def rl_results(run_dir: str, rm_type: str) -> dict:
    records = read_metrics(run_dir) if os.path.isdir(run_dir) else []
    return {"steps": len(records), "reward": [r.get("rollout/reward_mean") for r in records],
            "logprob_max_abs_diff": [r.get("train/rollout_logprob_max_abs_diff") for r in records],
            "logprob_mean_abs_diff": [r.get("train/rollout_logprob_abs_diff") for r in records],
            "response_len_mean": [r.get("rollout/response_len_mean") for r in records],
            "zero_std_frac": [r.get("rollout/zero_std_frac") for r in records],  # groups with no GRPO signal
            "trainer_peak_gib": max((r.get("perf/trainer_peak_memory_gib") or 0.0 for r in records), default=None),
            "engine_peak_gib": max((r.get("perf/engine_peak_memory_gib") or 0.0 for r in records), default=None),
            "eval": evaluations(run_dir, rm_type) if os.path.isdir(run_dir) else [], **timing(run_dir, records)}


def verdict(results: dict, rl_steps: int) -> dict:
    """The goal's three parts, each with its numbers, and whether all hold."""
    evals, diffs = results["rl"]["eval"], results["rl"]["logprob_max_abs_diff"]
    start = evals[0] if evals and evals[0]["version"] == 0 else None
    end = evals[-1] if evals and evals[-1]["version"] == rl_steps else None
    gain = 100.0 * (end["pass@1_recomputed"] - start["pass@1_recomputed"]) if start and end else None
    wall = sum(p["wall_s"] for p in results["phases"])
    checks = {
        "pass1_gain": {"start": start and start["pass@1_recomputed"], "end": end and end["pass@1_recomputed"],
                       "points": gain, "need": GOAL_POINTS, "met": gain is not None and gain >= GOAL_POINTS},
        "logprob_diff_zero": {"steps": len(diffs), "need_steps": rl_steps,
                              "max": max((d for d in diffs if d is not None), default=None),
                              "met": len(diffs) == rl_steps and all(d == 0.0 for d in diffs)},
        "wall_time": {"seconds": round(wall, 1), "need_below": GOAL_WALL_S, "met": wall < GOAL_WALL_S},
    }
    return {**checks, "met": all(c["met"] for c in checks.values())}


def verdict_lines(v: dict) -> list[str]:
    g, d, w = v["pass1_gain"], v["logprob_diff_zero"], v["wall_time"]
    ok = lambda c: "met" if c["met"] else "NOT met"  # noqa: E731
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    return [f"held-out pass@1   {fmt(g['start'], '.3f')} (SFT checkpoint) -> {fmt(g['end'], '.3f')} (end of RL):"
            f" {fmt(g['points'], '+.1f')} points, need >= +{g['need']:.0f}: {ok(g)}",
            f"logprob diff      max {fmt(d['max'], '.3g')} over {d['steps']} of {d['need_steps']} steps, need"
            f" exactly 0 every step: {ok(d)}",
            f"wall time         {w['seconds']:.0f}s (data + SFT + RL), need < {w['need_below']:.0f}s: {ok(w)}",
            f"goal              {'MET' if v['met'] else 'NOT MET'}"]


def memory_estimate(config: str, overrides: list[str]) -> dict:
    """Lockstep's pre-flight memory estimate of a phase (GiB) on the visible GPU, to set beside its peaks."""
    import torch

    from pipeline.config import load_config, memory

    cfg = load_config(os.path.join(REPO, config), overrides)
    est = memory.estimate(cfg, memory.local_placement(cfg, gpu_visible=True),
                          torch.cuda.get_device_properties(0).total_memory / 2**30)
    return {"total_gib": est.total / memory.GIB, "line": est.line()}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    loss = results["sft"]["loss"]
    ax0.plot(range(len(loss)), loss, color="tab:gray")
    ax0.set(title="SFT warm start", xlabel="step", ylabel="train/sft_loss (NLL per response token)")
    reward, evals = results["rl"]["reward"], results["rl"]["eval"]
    ax1.plot(range(len(reward)), reward, color="tab:blue", alpha=0.7, label="train reward (mean per step)")
    ax1.plot([e["version"] for e in evals], [e["pass@1_recomputed"] for e in evals], "o-", color="tab:red",
             label=f"held-out pass@1 ({evals[0]['num_prompts'] if evals else 0} problems)")
    ax1.set(title="GRPO, true on-policy", xlabel="step (weights version)", ylabel="exact-match rate", ylim=(0, 1))
    ax1.legend(loc="lower right")
    v = results.get("verdict")
    if v:
        fig.suptitle(f"{results['size']}: held-out pass@1 {v['pass1_gain']['points'] or 0:+.1f} points, "
                     f"max logprob diff {v['logprob_diff_zero']['max']}, {v['wall_time']['seconds']:.0f}s wall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: dict, out_dir: str) -> str:
    from pipeline.utils.fs import atomic_write_bytes

    path = os.path.join(out_dir, "gpu_learning.json")
    atomic_write_bytes(path, json.dumps(results, indent=1).encode())
    return path


def copy_run(run_dir: str, dest: str) -> None:
    """The run's small files (metrics, config, eval results, plot) beside the JSON; no weights."""
    rundir = RunDir(run_dir)
    os.makedirs(dest, exist_ok=True)
    for path in (rundir.metrics, rundir.config, rundir.reward_plot):
        if os.path.exists(path):
            shutil.copy(path, dest)
    if os.path.isdir(rundir.eval_dir):
        shutil.copytree(rundir.eval_dir, os.path.join(dest, "eval"), dirs_exist_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU: tiny model, 1-2 digit problems, few steps")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default 90; 30 with --tiny)")
    p.add_argument("--rl-steps", type=int, default=None, help="GRPO steps (default 400; 4 with --tiny)")
    p.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="override of the SFT config")
    p.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="override of the GRPO config")
    p.add_argument("--data", action="append", default=[], metavar="KEY=INT",
                   help="a size of the generated data (n_sft, n_train, n_test_per_digits, sft_max_digits, max_digits),"
                        " e.g. sft_max_digits=5: the warm start shows every length the held-out set has")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results/h200 or cpu)")
    p.add_argument("--work", default=None, help="data and run directories (default: a fresh temporary folder)")
    p.add_argument("--time-limit", type=float, default=570.0,
                   help="seconds for the whole driver; the RL phase gets what SFT left (default 570: under a"
                        " 10-minute device call)")
    a = p.parse_args()
    size = "tiny" if a.tiny else "gpu"
    sizes = dict(DATA[size])
    for item in a.data:
        key, _, value = item.partition("=")
        if key not in sizes or not value.strip().isdigit():
            p.error(f"--data {item}: give KEY=INT with KEY one of {', '.join(sizes)}")
        sizes[key] = int(value)
    if not 1 <= sizes["sft_max_digits"] <= sizes["max_digits"]:
        p.error(f"--data: sft_max_digits ({sizes['sft_max_digits']}) must be in 1..max_digits ({sizes['max_digits']})")
    sft_steps, rl_steps = a.sft_steps or STEPS[size][0], a.rl_steps or STEPS[size][1]
    out_dir = a.out or os.environ.get("OUT") or os.path.join(REPO, "bench", "results", "cpu" if a.tiny else "h200")
    work = a.work or tempfile.mkdtemp(prefix="lockstep-learning-")
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    results = {"size": size, "device": _device_name(a.tiny), "work": work, "goal": {
        "pass1_gain_points": GOAL_POINTS, "logprob_diff": 0.0, "wall_s_below": GOAL_WALL_S}, "phases": []}

    t0 = time.time()
    from pipeline.rollout.tasks import make_multidigit

    data = os.path.join(work, "data")
    results["data"] = {"dir": data, "sizes": sizes, "rows": make_multidigit(data, seed=0, **sizes)}
    results["phases"].append({"phase": "data", "rc": 0, "wall_s": round(time.time() - t0, 2)})

    sft_dir, rl_dir = os.path.join(work, "sft"), os.path.join(work, "grpo")
    sft_over = [f"run_dir={sft_dir}", f"num_rollout={sft_steps}", f"data.prompt_data={data}/sft.jsonl",
                *(TINY_SFT if a.tiny else []), *a.sft]
    remaining = lambda: a.time_limit - (time.time() - t_start)  # noqa: E731
    if not a.tiny:
        results["memory_estimate"] = {"sft": memory_estimate(SFT_CONFIG, sft_over)}
    results["phases"].append(run_phase("sft", SFT_CONFIG, sft_over, remaining()))
    results["sft"] = sft_results(sft_dir)
    save(results, out_dir)
    if results["phases"][-1]["rc"] != 0:
        return _finish(results, out_dir, rl_steps, failed=True)

    rl_over = [f"run_dir={rl_dir}", f"num_rollout={rl_steps}", f"model.path={RunDir(sft_dir).hf_export}",
               f"data.prompt_data={data}/train.jsonl", f"eval.datasets.{EVAL_SET}={data}/test.jsonl",
               *(TINY_RL if a.tiny else []), *a.rl]
    if not a.tiny:
        results["memory_estimate"]["rl"] = memory_estimate(RL_CONFIG, rl_over)
    results["phases"].append(run_phase("rl", RL_CONFIG, rl_over, remaining()))
    from pipeline.config import load_config

    rm_type = load_config(os.path.join(REPO, RL_CONFIG), rl_over).rollout.rm_type
    results["rl"] = rl_results(rl_dir, rm_type)
    copy_run(sft_dir, os.path.join(out_dir, "runs", "sft"))
    copy_run(rl_dir, os.path.join(out_dir, "runs", "grpo"))
    return _finish(results, out_dir, rl_steps, failed=results["phases"][-1]["rc"] != 0)


def _finish(results: dict, out_dir: str, rl_steps: int, failed: bool) -> int:
    results.setdefault("rl", rl_results("", "final_answer"))
    results["verdict"] = verdict(results, rl_steps)
    path = save(results, out_dir)
    plot(results, os.path.join(out_dir, "gpu_learning.png"))
    for ph in results["phases"]:
        print(f"{ph['phase']:<6} {ph['wall_s']:>7.1f}s  rc {ph['rc']}" + (f"  {ph['error']}" if ph.get("error") else ""))
    print("\n".join(verdict_lines(results["verdict"])))
    evals = results["rl"]["eval"] if results.get("rl") else []
    if evals:  # where the gain is (or is not): per length of the first operand, first and last evaluation
        first, last = evals[0]["pass@1_by_digits"], evals[-1]["pass@1_by_digits"]
        print("by length         " + ", ".join(f"{d} digits {first[d]:.2f} -> {last.get(d, 0.0):.2f}" for d in first))
    print(f"results: {path} and gpu_learning.png")
    return 1 if failed else 0


def _device_name(tiny: bool) -> str:
    if tiny:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU visible)"


if __name__ == "__main__":
    sys.exit(main())
