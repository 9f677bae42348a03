"""Evaluation (issue 23): pass@k, the schedule, the Evaluator on a real engine, evaluation inside sync and
async runs, a resume, `lockstep eval`, and bad eval input refused in one line."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from pipeline.algo.eval_metrics import ScoredSample, eval_summary, pass_at_k, pass_ks
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.observability.metrics import read_metrics
from pipeline.run import EvalDir, RunDir

from conftest import REPO, wait_until

TEST_SET = os.path.join(REPO, "data/arith/test.jsonl")
EVAL = ["eval.interval=2", "eval.n_samples_per_prompt=4"]


def lockstep(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def rows_of(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---- pass@k and the summary (pure) ----------------------------------------------------------------

def test_pass_at_k_against_a_hand_computation():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@4 = 1 (C(3,4) = 0)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_ks(16) == [1, 2, 4, 8, 16] and pass_ks(6) == [1, 2, 4] and pass_ks(1) == [1]


def test_pass_at_k_is_the_chance_that_k_drawn_samples_hold_a_correct_one():
    """The estimator equals the exact fraction of k-subsets with a correct sample (what it estimates)."""
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [i < c for i in range(n)]
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(correct, k))
                exact = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
                assert math.isclose(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


def test_eval_summary_of_a_hand_example():
    # prompt 0: rewards 1, 0 (one correct of 2); prompt 1: 0, 0; prompt 2: 1, 1. Only reward >= 1 passes.
    rewards = {0: [1.0, 0.0], 1: [0.0, 0.5], 2: [1.0, 1.0]}
    samples = [ScoredSample(prompt=p, reward=r, response_len=p + 1, truncated=(p == 1), weight_version=3 + (p == 2))
               for p, rs in rewards.items() for r in rs]
    m = eval_summary(samples, n_per_prompt=2)
    assert m["reward_mean"] == pytest.approx(3.5 / 6)
    assert m["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["response_len_mean"] == pytest.approx((1 + 1 + 2 + 2 + 3 + 3) / 6)
    assert m["truncated_frac"] == pytest.approx(2 / 6)
    assert (m["num_prompts"], m["num_samples"], m["weight_version"], m["weight_version_max"]) == (3, 6, 3, 4)


# ---- the schedule and the config ------------------------------------------------------------------

def test_eval_schedule():
    cfg = load_config("configs/tiny.yaml", ["eval.interval=2", f"eval.datasets.test={TEST_SET}"]).eval
    assert [v for v in range(10) if cfg.due(v, num_rollout=7)] == [0, 2, 4, 7]  # 6 = N-1: the final takes its place
    assert [v for v in range(10) if cfg.due(v, num_rollout=6)] == [0, 2, 4, 6]
    # metrics.jsonl: one record per step; the last step's record carries the final weights' evaluation
    assert [cfg.version_in_record(s, 7) for s in range(7)] == [0, None, 2, None, 4, None, 7]
    assert [cfg.version_in_record(s, 6) for s in range(6)] == [0, None, 2, None, 4, 6]
    off = load_config("configs/tiny.yaml", ["eval.interval=0"]).eval
    assert not any(off.due(v, 7) for v in range(8))


@pytest.mark.parametrize("overrides, fragment", [
    (["eval.interval=5", "eval.datasets={}"], "eval.datasets is empty"),
    (["eval.interval=-1"], "eval.interval must be >= 0"),
    (["eval.datasets={'a b': x.jsonl}"], "name 'a b' must be letters"),
    (["eval.datasets.summary=x.jsonl"], "'summary' is reserved"),
    (["eval.max_response_len=9"], "eval.max_response_len (9) > rollout.rollout_max_response_len (2)"),
    (["eval.temperature=-1"], "eval.temperature must be >= 0"),
    (["eval.datasets.t={rm_type: arith}"], "eval.datasets.t: path is required"),
    (["eval.n_samples_per_prompt=0"], "eval.n_samples_per_prompt must be > 0"),
])
def test_bad_eval_config_is_refused(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    assert fragment in str(e.value)


def test_eval_dataset_with_its_own_reward_function():
    cfg = load_config("configs/tiny.yaml", [f"eval.datasets.exact={{path: {TEST_SET}, rm_type: exact_match}}"])
    assert cfg.eval.datasets["exact"].rm_type == "exact_match" and cfg.eval.datasets["test"].rm_type is None


def test_an_override_below_a_bare_path_merges_with_it():
    """configs/tiny.yaml gives `test: data/arith/test.jsonl`: test.rm_type=... keeps that path."""
    cfg = load_config("configs/tiny.yaml", ["eval.datasets.test.rm_type=exact_match", "eval.datasets.test.input_key=q"])
    test = cfg.eval.datasets["test"]
    assert (test.path, test.rm_type, test.input_key, test.label_key) == ("data/arith/test.jsonl", "exact_match", "q", None)


def test_an_eval_set_reads_its_own_input_and_label_keys(tmp_path):
    from pipeline.models.tokenizer import build_tiny_tokenizer
    from pipeline.rollout.eval_data import load_eval_sets

    data = tmp_path / "qa.jsonl"
    data.write_text('{"q": "1+2=", "a": "3"}\n{"q": "2+2=", "a": "4"}\n')
    cfg = load_config("configs/tiny.yaml", [f"eval.datasets.qa={{path: {data}, input_key: q, label_key: a}}"])
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    qa, test = sorted(load_eval_sets(cfg, tok), key=lambda s: s.name)
    assert [(p.text, p.label) for p in qa.prompts] == [("1+2=", "3"), ("2+2=", "4")]
    assert test.stats.kept == 11 and test.prompts[0].label is not None  # data.input_key / label_key still


@pytest.mark.parametrize("make, override, fragment", [
    (None, "eval.datasets.test=/nonexistent/test.jsonl", "eval.datasets.test '/nonexistent/test.jsonl' not found"),
    ("", "eval.datasets.test={data}", "eval.datasets.test '{data}': no usable rows (file is empty)"),
    ('{"question": "1+1="}\n', "eval.datasets.test={data}",
     "eval.datasets.test '{data}': no usable rows (data: 0 of 1 rows of {data} kept; skipped 1: no 'prompt' field"
     " (1: line 1)) (set eval.datasets.test.input_key to the field that holds the prompt)"),
    (b'{"prompt": "caf\xe9"}\n', "eval.datasets.test={data}", "eval.datasets.test '{data}': line 1 is not UTF-8 text"),
    ('{"prompt": "1+1=", "label": "2"}\n', "eval.datasets.test={{path: {data}, rm_type: nosuch}}",
     "eval.datasets.test.rm_type 'nosuch': not one of"),
])
def test_bad_eval_input_is_one_line_before_anything_starts(tmp_path, make, override, fragment):
    data = tmp_path / "eval.jsonl"
    if make is not None:
        data.write_bytes(make if isinstance(make, bytes) else make.encode())
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", override.format(data=data), timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lockstep: error:"), res.stderr
    assert fragment.format(data=data) in lines[0], lines[0]
    assert not os.path.exists(RunDir(tmp_path / "run").config)  # refused before the run directory was made


@pytest.mark.parametrize("target, args, fragment", [
    ("/nonexistent", ["--dataset", f"test={TEST_SET}", "--out", "/tmp/x"], "is neither a run directory"),
    ("{model}", ["--out", "{tmp}/out"], "nothing to evaluate: give --dataset NAME=PATH"),
    ("{model}", ["--dataset", "test"], "--dataset 'test': expected NAME=PATH"),
    ("{model}", ["--dataset", f"test={TEST_SET}"], "give --out DIR"),
    ("{model}", ["--dataset", "test=/nonexistent.jsonl", "--out", "{tmp}/out"], "'/nonexistent.jsonl' not found"),
    ("{run}", [], "has no exported model (hf/)"),
])
def test_lockstep_eval_bad_input_is_one_line(tmp_path, dense_dir, target, args, fragment):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("num_rollout: 3\n")
    fmt = dict(model=dense_dir, tmp=tmp_path, run=run)
    res = lockstep("eval", target.format(**fmt), *(a.format(**fmt) for a in args), timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], res.stderr


# ---- the Evaluator on a real engine ---------------------------------------------------------------

def test_evaluator_on_a_real_engine(tmp_path, dense_dir, engine_factory):
    """Per-sample JSONL and summary written; sampling seeds make an evaluation reproducible; another step
    draws other seeds."""
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.rollout.client import EnginePool
    from pipeline.rollout.evaluation import Evaluator

    eng = engine_factory(dense_dir)
    cfg = load_config("configs/tiny.yaml", [f"eval.datasets={{test: {TEST_SET}, exact: {{path: {TEST_SET},"
                                            " rm_type: exact_match}}", "eval.n_samples_per_prompt=4",
                                            "eval.max_prompts=5", "rollout.rollout_max_response_len=3"])
    ev = Evaluator(cfg, load_tokenizer(dense_dir), EnginePool([eng.url]))
    outs = {name: EvalDir(str(tmp_path / name)) for name in ("a", "b", "other_step")}
    metrics = ev.evaluate(3, outs["a"])
    ev.evaluate(3, outs["b"])
    ev.evaluate(4, outs["other_step"])
    rows = rows_of(outs["a"].samples("test"))
    assert len(rows) == 5 * 4 and [r["prompt_idx"] for r in rows] == [i for i in range(5) for _ in range(4)]
    assert {"prompt", "label", "response", "response_ids", "response_len", "reward", "finish_reason",
            "weight_version", "seed"} <= set(rows[0])
    assert all(r["response_len"] == len(r["response_ids"]) <= 3 for r in rows)
    assert rows == rows_of(outs["b"].samples("test"))  # same seeds, same weights: the same responses
    other = rows_of(outs["other_step"].samples("test"))
    assert {r["seed"] for r in other}.isdisjoint({r["seed"] for r in rows})
    assert len({r["seed"] for r in rows}) == 20  # every sample its own seed
    summary = outs["a"].summary()
    assert summary["metrics"] == metrics and summary["step"] == 3 and set(summary["sets"]) == {"test", "exact"}
    for name in ("test", "exact"):
        for key in ("reward_mean", "pass@1", "pass@2", "pass@4", "response_len_mean", "truncated_frac",
                    "weight_version"):
            assert f"eval/{name}/{key}" in metrics
    assert metrics["eval/test/weight_version"] == 0
    assert metrics["eval/test/truncated_frac"] == pytest.approx(
        sum(r["finish_reason"] == "length" for r in rows) / len(rows))


# ---- whole runs -----------------------------------------------------------------------------------

def eval_records(run_dir) -> dict[int, dict]:
    """step -> its record's eval/test/* (only records that carry one)."""
    return {r["step"]: {k[len("eval/test/"):]: v for k, v in r.items() if k.startswith("eval/test/")}
            for r in read_metrics(str(run_dir)) if "eval/test/pass@1" in r}


@pytest.mark.slow
def test_eval_in_a_sync_run_then_lockstep_eval_on_its_model(tmp_path):
    """Sync mode: weights version K evaluated before step K's rollouts (0, 2), the final weights after the
    last step (5), each in its step's record; per-sample files written; the summary shows it. Then
    `lockstep eval` on the run's export gives the final evaluation again, token for token (same seeds,
    same weights, batch-invariant kernels), and on the model directory with its own settings."""
    from test_reliability import SMALL

    run_dir = tmp_path / "run"
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *EVAL, "num_rollout=5",
                   "logging.plot=true", "determinism.true_on_policy=true")
    assert res.returncode == 0, res.stderr[-3000:]
    rundir = RunDir(run_dir)
    assert rundir.eval_steps() == [0, 2, 5]
    records = eval_records(run_dir)
    assert {s: r["weight_version"] for s, r in records.items()} == {0: 0, 2: 2, 4: 5}
    assert all(r["weight_version_max"] == r["weight_version"] for r in records.values())
    for step in (0, 2, 5):
        rows = rows_of(rundir.eval_step(step).samples("test"))
        assert len(rows) == 11 * 4 and {r["weight_version"] for r in rows} == {step}
        summary = rundir.eval_step(step).summary()
        assert summary["metrics"]["eval/test/pass@1"] == pytest.approx(
            sum(r["reward"] >= 1 for r in rows) / len(rows))
    assert read_metrics(str(run_dir))[4]["eval/test/pass@4"] == rundir.eval_step(5).summary()["metrics"]["eval/test/pass@4"]
    assert "eval test" in res.stdout and "weights 0 -> 5" in res.stdout, res.stdout
    assert os.path.getsize(rundir.reward_plot) > 10_000

    again = lockstep("eval", str(run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "pass@4" in again.stdout and rundir.eval_hf.samples("test") in again.stdout
    ours, theirs = rows_of(rundir.eval_hf.samples("test")), rows_of(rundir.eval_step(5).samples("test"))
    assert [(r["seed"], r["response_ids"], r["reward"]) for r in ours] == \
        [(r["seed"], r["response_ids"], r["reward"]) for r in theirs]

    out = tmp_path / "model_eval"
    alone = lockstep("eval", rundir.hf_export, "--dataset", f"held={TEST_SET}", "--out", str(out),
                     "eval.n_samples_per_prompt=2", "eval.temperature=0", "eval.max_prompts=6")
    assert alone.returncode == 0, alone.stderr[-3000:]
    rows = rows_of(EvalDir(str(out)).samples("held"))
    assert len(rows) == 12 and all(a["response_ids"] == b["response_ids"] for a, b in zip(rows[::2], rows[1::2]))  # greedy
    assert EvalDir(str(out)).summary()["sampling"]["temperature"] == 0.0
    assert "held" in alone.stdout and "pass@2" in alone.stdout


@pytest.mark.slow
def test_eval_in_fully_async_mode_records_the_version_it_saw(tmp_path):
    """fully_async (2 versions of staleness): the rollout side evaluates whatever weights the engines hold
    when it reaches step K (K-2 .. K), and every record says which; the final weights are still version N."""
    from test_reliability import SMALL

    run_dir = tmp_path / "run"
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *EVAL, "num_rollout=6",
                   "rollout.mode=fully_async", "rollout.max_weight_staleness=2")
    assert res.returncode == 0, res.stderr[-3000:]
    rundir = RunDir(run_dir)
    assert rundir.eval_steps() == [0, 2, 4, 6]
    records = eval_records(run_dir)
    assert sorted(records) == [0, 2, 4, 5]
    assert records[0]["weight_version"] == 0 and records[5]["weight_version"] == 6
    for step in (2, 4):
        r = records[step]
        assert step - 2 <= r["weight_version"] <= r["weight_version_max"] <= step, (step, r)
        versions = {row["weight_version"] for row in rows_of(rundir.eval_step(step).samples("test"))}
        assert min(versions) == r["weight_version"] and max(versions) == r["weight_version_max"]


@pytest.mark.slow
def test_a_resumed_run_neither_loses_nor_repeats_evaluations(tmp_path):
    """Stopped mid-run and started again (resuming from its checkpoint): every evaluation once, in its
    record, and its files with one row per sample."""
    from test_reliability import SMALL, launch

    run_dir = tmp_path / "run"
    args = [*EVAL, "num_rollout=8", "checkpoint.save_interval=2"]
    p = launch(run_dir, *args)
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 4, timeout=300)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    stopped_at = len(read_metrics(str(run_dir)))
    assert stopped_at < 8
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(8))
    assert {s: r["weight_version"] for s, r in eval_records(run_dir).items()} == {0: 0, 2: 2, 4: 4, 6: 6, 7: 8}
    rundir = RunDir(run_dir)
    assert rundir.eval_steps() == [0, 2, 4, 6, 8]
    for step in rundir.eval_steps():
        assert len(rows_of(rundir.eval_step(step).samples("test"))) == 11 * 4
