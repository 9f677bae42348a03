"""bench/gpu_learning.py, the GPU learning recipe's driver: its numbers against hand computations, and
the whole pipeline (data, SFT, GRPO from the SFT export, evaluation, results JSON, plot) on CPU with
--tiny."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.run import RunDir

from conftest import REPO

sys.path.insert(0, REPO)
from bench import gpu_learning  # noqa: E402


PROMPTS = {0: "1+2=", 1: "74+7="}


def write_eval(run_dir: str, step: int, samples: list[tuple[int, str, str, float]], pass1: float) -> None:
    """An evaluation of weights version `step`: (prompt index, response, label, stored reward) per sample."""
    ev = RunDir(run_dir).eval_step(step)
    os.makedirs(ev.root, exist_ok=True)
    with open(ev.samples("test"), "w") as f:
        for i, (p, response, label, reward) in enumerate(samples):
            f.write(json.dumps({"prompt_idx": p, "sample": i, "prompt": PROMPTS[p], "response": response,
                                "label": label, "reward": reward}) + "\n")
    ev.publish_summary({"step": step, "metrics": {"eval/test/pass@1": pass1, "eval/test/pass@2": 0.0}})


def test_pass1_is_recomputed_from_the_samples_and_the_goal_checked(tmp_path):
    run = str(tmp_path / "run")
    # version 0: prompt 0 one of two right, prompt 1 none: pass@1 (0.5 + 0) / 2 = 0.25
    write_eval(run, 0, [(0, "1+2+0=3 >3", "3", 1.0), (0, "1+2+0=3 >4", "3", 0.0),
                        (1, "9+9+0=18 >18", "81", 0.0), (1, "no answer", "81", 0.0)], pass1=0.25)
    # version 3: both right on prompt 0, one on prompt 1 (stored as wrong: a mismatch the driver counts)
    write_eval(run, 3, [(0, ">3", "3", 1.0), (0, " >3\n", "3", 1.0), (1, ">81", "81", 0.0), (1, ">8", "81", 0.0)],
               pass1=0.5)
    evals = gpu_learning.evaluations(run, "final_answer")
    assert [e["version"] for e in evals] == [0, 3]
    assert evals[0]["pass@1_recomputed"] == 0.25 and evals[0]["reward_mismatches"] == 0
    assert evals[1]["pass@1_recomputed"] == 0.75 and evals[1]["pass@1"] == 0.5 and evals[1]["reward_mismatches"] == 1
    assert evals[0]["num_prompts"] == 2 and evals[0]["num_samples"] == 4 and evals[0]["pass@2"] == 0.0
    # per length of the first operand (prompt 0: 1 digit, prompt 1: 2)
    assert evals[0]["pass@1_by_digits"] == {"1": 0.5, "2": 0.0} and evals[1]["pass@1_by_digits"] == {"1": 1.0, "2": 0.5}

    results = {"phases": [{"wall_s": 100.0}, {"wall_s": 250.5}],
               "rl": {"eval": evals, "logprob_max_abs_diff": [0.0, 0.0, 0.0]}}
    v = gpu_learning.verdict(results, rl_steps=3)
    assert v["pass1_gain"]["points"] == pytest.approx(50.0) and v["pass1_gain"]["met"]
    assert v["logprob_diff_zero"]["met"] and v["wall_time"] == {"seconds": 350.5, "need_below": 600.0, "met": True}
    assert v["met"]
    results["rl"]["logprob_max_abs_diff"] = [0.0, 1e-9, 0.0]  # one step off: not true on-policy
    assert not gpu_learning.verdict(results, rl_steps=3)["logprob_diff_zero"]["met"]
    results["rl"]["logprob_max_abs_diff"] = [0.0, 0.0]  # a step missing (the run was cut off)
    v = gpu_learning.verdict(results, rl_steps=3)
    assert not v["logprob_diff_zero"]["met"] and not v["met"]
    assert gpu_learning.verdict(results, rl_steps=4)["pass1_gain"]["end"] is None  # no eval of the final weights
    lines = gpu_learning.verdict_lines(gpu_learning.verdict(results, rl_steps=3))
    assert lines[0].startswith("held-out pass@1   0.250 (SFT checkpoint) -> 0.750 (end of RL): +50.0 points")
    assert lines[-1] == "goal              NOT MET"


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    res = subprocess.run([sys.executable, "bench/gpu_learning.py", "--tiny", "--out", str(out), "--work", str(work)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "gpu_learning.json") as f:
        r = json.load(f)
    assert r["size"] == "tiny" and [p["phase"] for p in r["phases"]] == ["data", "sft", "rl"]
    assert all(p["rc"] == 0 and p["wall_s"] > 0 for p in r["phases"])
    assert r["data"]["rows"] == {"sft": 1500, "train": 1500, "test": 16}

    # SFT: one loss per step, as the run logged it, falling
    sft_steps, rl_steps = gpu_learning.STEPS["tiny"]
    sft_records = [json.loads(line) for line in open(out / "runs" / "sft" / "metrics.jsonl")]
    assert r["sft"]["steps"] == sft_steps and r["sft"]["loss"] == [x["train/sft_loss"] for x in sft_records]
    assert r["sft"]["loss"][-1] < r["sft"]["loss"][0] and r["sft"]["startup_s"] > 0

    # RL: per-step reward and logprob difference as logged; true on-policy: exactly 0 every step
    rl_records = [json.loads(line) for line in open(out / "runs" / "grpo" / "metrics.jsonl")]
    assert r["rl"]["steps"] == rl_steps == len(rl_records)
    assert r["rl"]["reward"] == [x["rollout/reward_mean"] for x in rl_records]
    assert r["rl"]["logprob_max_abs_diff"] == [0.0] * rl_steps
    config = open(out / "runs" / "grpo" / "config.yaml").read()
    assert "true_on_policy: true" in config and "/sft/hf" in config  # RL started from the SFT export

    # evaluations at versions 0, 2 and 4 (eval.interval=2), pass@1 recomputed here by hand from the files
    assert [e["version"] for e in r["rl"]["eval"]] == [0, 2, rl_steps]
    from pipeline.rollout.rewards import final_answer_reward

    for e in r["rl"]["eval"]:
        rows = [json.loads(line) for line in open(out / "runs" / "grpo" / "eval" / f"step_{e['version']}" / "test.jsonl")]
        per_prompt: dict[int, list[float]] = {}
        for s in rows:
            assert s["weight_version"] == e["version"]
            per_prompt.setdefault(s["prompt_idx"], []).append(final_answer_reward(s["response"], s["label"], {}))
        assert len(per_prompt) == 16 and all(len(v) == 2 for v in per_prompt.values())
        by_hand = sum(sum(v) / 2 for v in per_prompt.values()) / 16
        assert e["pass@1_recomputed"] == pytest.approx(by_hand) and e["pass@1"] == pytest.approx(by_hand)
        assert e["reward_mismatches"] == 0

    v = r["verdict"]
    assert v["pass1_gain"]["start"] == r["rl"]["eval"][0]["pass@1_recomputed"]
    assert v["pass1_gain"]["points"] == pytest.approx(100 * (v["pass1_gain"]["end"] - v["pass1_gain"]["start"]))
    assert v["logprob_diff_zero"]["met"] and v["wall_time"]["met"]
    assert v["met"] == v["pass1_gain"]["met"]  # a tiny model in 4 steps is not expected to gain 20 points
    assert (out / "gpu_learning.png").stat().st_size > 10_000
    assert "goal              " in res.stdout and "logprob diff      max 0 over 4 of 4 steps" in res.stdout
