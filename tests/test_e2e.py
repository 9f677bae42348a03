"""Whole jobs through `lockstep run`: learning, outputs, failure handling, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.models.hf_io import read_state_dict
from pipeline.observability.metrics import read_metrics

from conftest import REPO, wait_until

REQUIRED_KEYS = {"step", "rollout/reward_mean", "train/loss", "train/rollout_logprob_abs_diff",
                 "train/rollout_logprob_max_abs_diff", "perf/step_time_s", "perf/rollout_time_s",
                 "perf/train_time_s", "perf/weight_sync_time_s", "weights/version"}


def lockstep(*args, timeout=900, **kw):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kw)


def procs_of(run_dir) -> list[int]:
    """PIDs of live processes whose command line names this run directory."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
                state = open(f"/proc/{pid}/stat").read().split()[2]
            except OSError:
                continue
            if str(run_dir) in cmd and state != "Z":
                out.append(int(pid))
    return out


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_tiny_recipe_learns(tmp_path):
    """A shorter run of the default recipe: reward rises clearly, and every output a user looks at exists."""
    run_dir = tmp_path / "run"
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", "num_rollout=100")
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(100))
    assert REQUIRED_KEYS <= set(records[0])
    first = mean([r["rollout/reward_mean"] for r in records[:3]])
    last = mean([r["rollout/reward_mean"] for r in records[-3:]])
    assert first < 0.3 and last > 0.6, (first, last)
    assert [r["weights/version"] for r in records] == list(range(1, 101))
    # Engine and trainer run the same fp32 model: their logprobs agree closely (bitwise in true on-policy mode).
    assert max(r["train/rollout_logprob_max_abs_diff"] for r in records) < 1e-4
    assert "reward" in res.stdout and "->" in res.stdout  # the summary
    assert os.path.getsize(run_dir / "reward.png") > 10_000
    # The exported policy is a Hugging Face directory transformers can load.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"), dtype=torch.float32)
    assert hf.config.model_type == "qwen3"
    final = read_state_dict(str(run_dir / "hf"))
    init = read_state_dict(str(run_dir / "model_init"))
    assert any(not torch.equal(final[k], init[k]) for k in final)
    verify = lockstep("buffer", "verify", str(run_dir))
    assert verify.returncode == 0 and "OK: 100 committed steps" in verify.stdout


FAST = ["num_rollout=6", "rollout_batch_size=8", "global_batch_size=64", "checkpoint.export_hf=false",
        "logging.plot=false"]


def test_two_trainer_ranks_and_two_engines(tmp_path):
    res = lockstep("run", "configs/tiny.yaml", f"run_dir={tmp_path}/run", *FAST, "train.num_gpus=2",
                   "engine.num_engines=2", "buffer.keep_consumed=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    from pipeline.buffer.reader import BufferReader

    assert BufferReader(f"{tmp_path}/run/buffer").committed_steps() == [5]  # consumed steps collected, newest kept
    records = read_metrics(f"{tmp_path}/run")
    assert len(records) == 6 and records[-1]["weights/version"] == 6
    assert records[0]["train/rollout_logprob_max_abs_diff"] < 1e-4


def test_failed_component_ends_the_job_and_is_named(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "configs/tiny.yaml", f"run_dir={run_dir}",
                          "num_rollout=500", "engine.max_restarts=0", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 2, timeout=120)
    engine = json.load(open(run_dir / "rendezvous" / "engine_0.json"))
    os.kill(engine["pid"], signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "component 'engine_0' failed" in err
    assert wait_until(lambda: not procs_of(run_dir), timeout=20), procs_of(run_dir)


def test_sigterm_to_launcher_leaves_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "configs/tiny.yaml", f"run_dir={run_dir}",
                          "num_rollout=500", "--no-progress"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: len(read_metrics(str(run_dir))) >= 1, timeout=120)
    assert len(procs_of(run_dir)) >= 4  # launcher, engine, rollout manager, trainer
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 130
    assert wait_until(lambda: not procs_of(run_dir), timeout=20), procs_of(run_dir)
