"""What a person looks at: the progress line while a run goes, a summary and a reward curve at the end."""

from __future__ import annotations

import os
import sys
import time

from pipeline.observability.metrics import read_metrics
from pipeline.observability.startup import startup_line
from pipeline.observability.tensorboard_sink import tensorboard_dir
from pipeline.observability.wandb_sink import wandb_dir, wandb_state
from pipeline.run import RunDir


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


class ProgressBar:
    """A one-line bar on stderr: step k/N, reward, loss, step time, ETA. Plain lines when not a TTY."""

    def __init__(self, total: int, enabled: bool = True, stream=sys.stderr):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.last_step = -1

    def update(self, records: list[dict], status: str = "") -> None:
        if not self.enabled:
            return
        done = len(records)
        if not records:
            line = f"[{'.' * 30}] 0/{self.total} {status}"
        else:
            every = max(self.total // 20, 1)  # a log file gets ~20 lines, a terminal a live bar
            if not self.tty and (records[-1]["step"] == self.last_step or (done % every and done != self.total)):
                return
            r = records[-1]
            self.last_step = r["step"]
            frac = min(done / self.total, 1.0)
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            step_t = mean([x.get("perf/step_time_s") for x in records[-5:]])
            eta = step_t * (self.total - done)
            head = (f"sft_loss {r['train/sft_loss']:.4f}" if "train/sft_loss" in r else
                    f"reward {r.get('rollout/reward_mean', float('nan')):.3f} loss {r.get('train/loss', float('nan')):+.4f}")
            line = f"[{bar}] {done}/{self.total} {head} step {step_t:.2f}s eta {eta:.0f}s"
        if self.tty:
            self.stream.write("\r" + line.ljust(100)[:120])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def step_split(records: list[dict], warmup: int = 1) -> dict:
    """Where a step's time goes, averaged over the steps after `warmup` (all when there are no more):
    seconds of rollout / train / weight sync, their shares of the step, and response tokens generated
    per second of the whole step, of the rollout phase and trained per second of the train phase."""
    steady = records[warmup:] or records
    sec = {k: mean([r.get(f"perf/{k}_time_s") for r in steady]) for k in ("step", "rollout", "train", "weight_sync")}
    tokens = mean([r.get("rollout/tokens") for r in steady])
    out = {"steps": len(steady), **{f"{k}_s": v for k, v in sec.items()}, "response_tokens": tokens,
           "tokens_per_s": tokens / sec["step"], "rollout_tokens_per_s": tokens / sec["rollout"],
           "train_tokens_per_s": mean([r.get("train/tokens") for r in steady]) / sec["train"]}
    out.update({f"{k}_frac": sec[k] / sec["step"] for k in ("rollout", "train", "weight_sync")})
    return out


def is_sft(records: list[dict]) -> bool:
    """A supervised run (algo.loss_type=sft_loss): an SFT loss, no rewards."""
    return bool(records) and "train/sft_loss" in records[-1] and "rollout/reward_mean" not in records[-1]


def sft_lines(records: list[dict]) -> list[str]:
    """An SFT run's loss curve ends, how much data it saw, and its training speed."""
    first, last, steady = records[:3], records[-3:], records[1:] or records
    train_s = mean([r.get("perf/train_time_s") for r in steady])
    return [
        f"sft loss          {mean([r.get('train/sft_loss') for r in first]):.4f} (first 3 steps)"
        f" -> {mean([r.get('train/sft_loss') for r in last]):.4f} (last 3; mean NLL per response token)",
        f"data              {records[-1].get('data/epoch', float('nan')):.2f} epochs,"
        f" {sum(r.get('train/tokens') or 0 for r in records):.0f} response tokens trained",
        f"time per step     {mean([r.get('perf/step_time_s') for r in steady]):.2f}s (train {train_s:.2f}s;"
        f" steps after the first)",
        f"throughput        {mean([r.get('train/tokens') for r in steady]) / train_s:.0f} response tokens/s trained",
    ]


def summary(run_dir: str) -> str:
    records = read_metrics(run_dir)
    if not records:
        return f"no steps recorded in {run_dir}"
    head = [f"run_dir           {run_dir}",
            f"steps             {len(records)} (weights version {records[-1].get('weights/version')})"]
    lines = head + (sft_lines(records) if is_sft(records) else rl_lines(records))
    lines += [f"total time        {sum(r.get('perf/step_time_s') or 0 for r in records):.0f}s"]
    lines += eval_lines(records)
    started = startup_line(run_dir)
    if started:
        lines.append(f"start-up          {started}")
    rundir = RunDir(run_dir)
    for what, path in (("plot", rundir.reward_plot), ("final model", rundir.hf_export)):
        if os.path.exists(path):
            lines.append(f"{what:<18}{path}")
    lines += tracker_lines(run_dir)
    return "\n".join(lines)


def rl_lines(records: list[dict]) -> list[str]:
    """An RL run's reward curve ends, the trainer-engine logprob difference, where a step's time goes."""
    first, last = records[:3], records[-3:]
    split = step_split(records)
    return [
        f"reward            {mean([r.get('rollout/reward_mean') for r in first]):.3f} (first 3 steps)"
        f" -> {mean([r.get('rollout/reward_mean') for r in last]):.3f} (last 3)",
        f"response length   {mean([r.get('rollout/response_len_mean') for r in last]):.2f} tokens (last 3)",
        f"logprob |diff|    mean {mean([r.get('train/rollout_logprob_abs_diff') for r in records]):.3g},"
        f" max {max((r.get('train/rollout_logprob_max_abs_diff') or 0) for r in records):.3g} (trainer vs engine)",
        f"time per step     {split['step_s']:.2f}s = rollout {split['rollout_s']:.2f}s + train {split['train_s']:.2f}s"
        f" + weight sync {split['weight_sync_s']:.3f}s (steps after the first)",
        f"throughput        {split['tokens_per_s']:.0f} response tokens/s over whole steps"
        f" (rollout {split['rollout_tokens_per_s']:.0f}/s, train {split['train_tokens_per_s']:.0f}/s)",
    ]


def eval_series(records: list[dict]) -> dict[str, list[tuple[int, dict]]]:
    """eval set name -> [(step, {metric: value})] in step order, from the records that carry eval/<name>/*."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for r in records:
        found: dict[str, dict] = {}
        for key, value in r.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval":
                found.setdefault(parts[1], {})[parts[2]] = value
        for name, values in found.items():
            out.setdefault(name, []).append((r["step"], values))
    return out


def eval_lines(records: list[dict]) -> list[str]:
    """Per eval set: pass@1 (and pass@n for n samples per prompt) of the first and the last evaluation,
    with the weight versions they evaluated."""
    lines = []
    for name, series in eval_series(records).items():
        first, last = series[0][1], series[-1][1]
        ks = sorted(int(k[5:]) for k in last if k.startswith("pass@"))
        change = ", ".join(f"pass@{k} {first.get(f'pass@{k}', float('nan')):.3f} -> {last[f'pass@{k}']:.3f}"
                           for k in sorted({1, ks[-1]}))
        lines.append(f"{'eval ' + name:<18}{change} (weights {first.get('weight_version')} ->"
                     f" {last.get('weight_version')}; {len(series)} evals of {last.get('num_prompts')} prompts"
                     f" x {last.get('num_samples', 0) // max(last.get('num_prompts') or 1, 1)} samples)")
    return lines


def eval_table(summary: dict) -> str:
    """An evaluation's summary.json as a table: one row per set."""
    metrics, n = summary["metrics"], summary["n_samples_per_prompt"]
    ks = [f"pass@{k}" for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n]
    head = ["set", "prompts", "samples", "reward", *ks, "resp len", "truncated", "weights"]
    rows = [head]
    for name in summary["sets"]:
        m = {k.split("/", 2)[2]: v for k, v in metrics.items() if k.startswith(f"eval/{name}/")}
        rows.append([name, str(m["num_prompts"]), str(m["num_samples"]), f"{m['reward_mean']:.3f}",
                     *(f"{m[k]:.3f}" for k in ks), f"{m['response_len_mean']:.2f}", f"{m['truncated_frac']:.3f}",
                     str(m["weight_version"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def tracker_lines(run_dir: str) -> list[str]:
    """Where the run's TensorBoard files and W&B run are, and the command that shows / uploads them."""
    lines = []
    if os.path.isdir(tensorboard_dir(run_dir)):
        lines.append(f"{'tensorboard':<18}tensorboard --logdir {tensorboard_dir(run_dir)}")
    state = wandb_state(run_dir)
    if state:
        where = state.get("url") or f"offline; upload: wandb sync {wandb_dir(run_dir)}/offline-run-*"
        lines.append(f"{'wandb':<18}run {state['id']}, {where}")
    return lines


def plot_rewards(run_dir: str) -> str | None:
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    if is_sft(records):  # no rewards, no engines: the loss curve and the data seen
        axes[0].plot(steps, [r.get("train/sft_loss") for r in records], marker="o", ms=3)
        axes[0].set(title="SFT loss (train/sft_loss, NLL per token)", xlabel="step")
        axes[1].plot(steps, [r.get("data/epoch") for r in records])
        axes[1].set(title="epochs of the data file (data/epoch)", xlabel="step")
    else:
        axes[0].plot(steps, [r.get("rollout/reward_mean") for r in records], marker="o", ms=3, label="rollout reward")
        evals = eval_series(records)
        for name, series in evals.items():  # at the weights version evaluated (the step's, or the final)
            axes[0].plot([v.get("weight_version") for _, v in series], [v.get("pass@1") for _, v in series],
                         marker="s", ms=4, label=f"eval {name} pass@1")
        axes[0].set(title="reward (rollout/reward_mean)" + (", held-out pass@1" if evals else ""), xlabel="step",
                    ylim=(-0.02, 1.02))
        axes[0].legend(loc="lower right")
        axes[1].plot(steps, [r.get("train/rollout_logprob_abs_diff") for r in records], label="mean")
        axes[1].plot(steps, [r.get("train/rollout_logprob_max_abs_diff") for r in records], label="max")
        axes[1].set(title="|trainer - engine| logprob", xlabel="step")
        axes[1].legend()
    phases = (("perf/rollout_time_s", "rollout"), ("perf/train_time_s", "train"), ("perf/weight_sync_time_s", "weight sync"))
    for key, label in phases[1:2] if is_sft(records) else phases:
        axes[2].plot(steps, [r.get(key) for r in records], label=label)
    axes[2].set(title="time per step (s)", xlabel="step")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = RunDir(run_dir).reward_plot
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
