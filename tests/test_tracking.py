"""Metric sinks beside metrics.jsonl: TensorBoard event files and a Weights & Biases offline run hold the
same steps, keys and values, read back with the trackers' own readers; a resume keeps one value per
step; a missing package is refused in one line before anything starts. No network: W&B runs offline
(and in its own config/cache directories)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.observability.metrics import read_metrics
from pipeline.observability.miles_names import MILES_ALIASES
from pipeline.observability.sinks import open_sinks
from pipeline.observability.wandb_sink import read_wandb_file, wandb_state

from conftest import REPO

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    """No run here reaches wandb.ai: offline, no error reports, and W&B's own files under tmp_path."""
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                 "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                 "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(k, v)


# ---- the trackers' own readers ---------------------------------------------------------------------

def tb_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (purges of re-run steps applied). (W&B 0.31 has no
    Python reader of its .wandb files any more; the sink's read_wandb_file parses them into wandb's own
    protobuf records.)"""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    out = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    out["config"] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("config/text_summary")]
    return out


def wandb_runs(run_dir) -> list[dict]:
    """Each offline run directory's id, config and history ({step: {key: value}}), oldest first."""
    root = os.path.join(run_dir, "wandb")
    runs = []
    for name in sorted(d for d in os.listdir(root) if d.startswith("offline-run-")):
        (path,) = [os.path.join(root, name, f) for f in os.listdir(os.path.join(root, name)) if f.endswith(".wandb")]
        run = {"dir": name, "id": None, "config": {}, "history": {}}
        for r in read_wandb_file(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
                run["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                run["history"][r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        runs.append(run)
    return runs


def numeric_items(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


# ---- a real job, then a resume of it ---------------------------------------------------------------

TRACKED = ["logging.tensorboard=true", "logging.wandb.enabled=true", "logging.wandb.mode=offline",
           "logging.wandb.project=lockstep-test", "logging.wandb.group=ci", "checkpoint.save_interval=2",
           "checkpoint.save_final=false", "checkpoint.export_hf=false",
           "eval.interval=20"]  # the recipe's evaluations too (SMALL turns them off): eval/* go to every sink


@pytest.fixture(scope="module")
def tracked_runs(tmp_path_factory):
    """`lockstep run` of 3 steps (a checkpoint after step 1), read back; then the same run directory
    with num_rollout=4: resumes from the checkpoint, re-runs step 2, runs step 3; read back again."""
    from test_e2e import lockstep
    from test_reliability import SMALL

    tmp = tmp_path_factory.mktemp("tracking")
    run_dir = str(tmp / "run")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_ERROR_REPORTING="false",
               WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"))
    out = {}
    for name, steps in (("first", 3), ("resumed", 4)):
        res = lockstep("run", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *TRACKED, f"num_rollout={steps}",
                       env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        out[name] = {"metrics": read_metrics(run_dir), "tb": tb_scalars(run_dir), "wandb": wandb_runs(run_dir),
                     "state": wandb_state(run_dir), "summary": res.stdout}
    out["run_dir"] = run_dir
    return out


def assert_tb_matches(metrics: list[dict], tb: dict) -> None:
    """Every numeric key of every step: exactly the float32 TensorBoard stores; one value per step."""
    for key in {k for r in metrics for k in numeric_items(r)}:
        want = [(r["step"], np.float32(r[key])) for r in metrics if r.get(key) is not None]
        got = tb[key]
        assert [s for s, _ in got] == [s for s, _ in want], (key, got)
        assert all(np.float32(g) == w for (_, g), (_, w) in zip(got, want)), (key, got, want)
    for ours, miles in MILES_ALIASES.items():  # Miles' names: a copy of ours
        if ours in tb:
            assert tb[miles] == tb[ours]


@pytest.mark.slow
def test_tensorboard_holds_the_values_of_metrics_jsonl(tracked_runs):
    first = tracked_runs["first"]
    assert [r["step"] for r in first["metrics"]] == [0, 1, 2]
    assert_tb_matches(first["metrics"], first["tb"])
    assert "train/train_rollout_logprob_abs_diff" in first["tb"] and "perf/rollout_time" in first["tb"]
    (config,) = first["tb"]["config"]  # the resolved config, once, as text
    assert config[0] == 0 and "num_rollout: 3" in config[1] and "tensorboard: true" in config[1]


@pytest.mark.slow
def test_wandb_offline_run_holds_the_same_keys_and_values(tracked_runs):
    first = tracked_runs["first"]
    (run,) = first["wandb"]
    assert run["id"] == first["state"]["id"] and first["state"]["mode"] == "offline"
    assert sorted(run["history"]) == [0, 1, 2]
    for r in first["metrics"]:
        logged = run["history"][r["step"]]
        ours = numeric_items(r)
        # The same keys as TensorBoard: ours and Miles' names of those Miles has.
        assert set(logged) == set(ours) | {MILES_ALIASES[k] for k in ours if k in MILES_ALIASES}
        for k, v in ours.items():
            assert logged[k] == v, k  # W&B keeps the float64
    assert {k for row in run["history"].values() for k in row} == set(first["tb"]) - {"config"}
    # The resolved config is the run's config; project / group / mode as configured.
    assert run["config"]["num_rollout"] == 3 and run["config"]["logging"]["wandb"]["group"] == "ci"
    assert "wandb sync" in first["summary"] and "tensorboard --logdir" in first["summary"]


@pytest.mark.slow
def test_resume_keeps_one_value_per_step(tracked_runs):
    first, resumed = tracked_runs["first"], tracked_runs["resumed"]
    metrics = resumed["metrics"]
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    # TensorBoard: the re-run step 2 replaced the first run's (purge_step), like metrics.jsonl.
    assert_tb_matches(metrics, resumed["tb"])
    assert len(resumed["tb"]["config"]) == 1  # logged once: the resume kept the first start's
    # Training is deterministic: the re-run step's losses equal the first run's.
    assert metrics[2]["train/loss"] == first["metrics"][2]["train/loss"]
    # W&B: the same run id continues in a second offline directory; steps only increase, so step 2 is
    # not logged again: each step once over both, step 2 with the first run's values.
    a, b = resumed["wandb"]
    assert a["id"] == b["id"] == first["state"]["id"] == resumed["state"]["id"]
    assert sorted(a["history"]) == [0, 1, 2] and sorted(b["history"]) == [3]
    assert a["history"][2] == first["wandb"][0]["history"][2]
    assert {k: v for k, v in b["history"][3].items() if k in metrics[3]} == numeric_items(metrics[3])


# ---- the sinks alone (no job) ----------------------------------------------------------------------

def test_sinks_agree_on_keys_and_handle_non_numeric_values(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", *TRACKED[:3]])
    sinks = open_sinks(cfg, run_dir, start_step=0)
    records = [{"step": s, "train/loss": 0.5 - s, "train/rollout_logprob_abs_diff": 1e-9 * s, "train/flag": True,
                "train/skipped_steps": s, "train/grad_norm": float("nan") if s == 1 else 1.0,
                "rollout/note": f"text {s}", "rollout/none": None} for s in range(3)]
    for r in records:
        sinks.write(r)
    sinks.close()
    jsonl = read_metrics(run_dir)
    assert jsonl[1]["train/grad_norm"] is None and jsonl[2]["rollout/note"] == "text 2"  # JSON has no NaN
    tb = tb_scalars(run_dir)
    (run,) = wandb_runs(run_dir)
    assert set(tb) - {"config"} == set(run["history"][0]) == {
        "train/loss", "train/rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff", "train/flag",
        "train/skipped_steps", "train/grad_norm"}  # strings and None in neither
    assert math.isnan(tb["train/grad_norm"][1][1]) and tb["train/flag"][0] == (0, 1.0)
    assert math.isnan(run["history"][1]["train/grad_norm"])
    assert run["config"]["rollout/note"] == "text 2"  # strings: W&B run config (last value)


def test_a_resume_keeps_one_value_per_step_in_each_sink(tmp_path):
    """The sinks alone, as a resumed trainer opens them: start_step=1 re-runs steps 1 and 2."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", *TRACKED[:3]])
    for start, stop, loss in ((0, 3, 1.0), (1, 4, 2.0)):
        sinks = open_sinks(cfg, run_dir, start_step=start)
        for step in range(start, stop):
            sinks.write({"step": step, "train/loss": loss + step})
        sinks.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(run_dir)] == [(0, 1.0), (1, 3.0), (2, 4.0), (3, 5.0)]
    assert tb_scalars(run_dir)["train/loss"] == [(0, 1.0), (1, 3.0), (2, 4.0), (3, 5.0)]
    first, second = wandb_runs(run_dir)  # W&B: re-run steps keep their first values
    assert first["id"] == second["id"]
    assert {s: h["train/loss"] for s, h in {**first["history"], **second["history"]}.items()} == {
        0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0}
    assert sorted(second["history"]) == [3]


def test_steps_a_killed_trainer_took_with_it_are_logged_by_the_rerun(tmp_path):
    """wandb-core writes its records in batches: a process killed before the batch is out leaves an
    offline file without them. The resume asks W&B's files what they hold, not its own notes, so the
    re-run logs those steps (here all of them: the killed start got none out)."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    overrides = [f"run_dir={run_dir}", *TRACKED[:3]]
    code = ("import os; from pipeline.config import load_config; from pipeline.observability.sinks import open_sinks;"
            f" s = open_sinks(load_config('configs/tiny.yaml', {overrides!r}), {run_dir!r}, 0);"
            " [s.write({'step': i, 'train/loss': 1.0 + i}) for i in range(3)]; os.kill(os.getpid(), 9)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == -9, res.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    (killed,) = wandb_runs(run_dir)
    assert killed["history"] == {}  # nothing reached the file within its 15 s flush interval
    sinks = open_sinks(load_config("configs/tiny.yaml", overrides), run_dir, start_step=1)
    for step in range(1, 4):
        sinks.write({"step": step, "train/loss": 2.0 + step})
    sinks.close()
    _, rerun = wandb_runs(run_dir)
    assert {s: h["train/loss"] for s, h in rerun["history"].items()} == {1: 3.0, 2: 4.0, 3: 5.0}
    assert tb_scalars(run_dir)["train/loss"] == [(0, 1.0), (1, 3.0), (2, 4.0), (3, 5.0)]


def test_miles_aliases_can_be_turned_off(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", "logging.tensorboard=true",
                                            "logging.miles_aliases=false"])
    sinks = open_sinks(cfg, run_dir)
    sinks.write({"step": 0, "train/rollout_logprob_abs_diff": 0.0})
    sinks.close()
    assert set(tb_scalars(run_dir)) == {"train/rollout_logprob_abs_diff", "config"}


@pytest.mark.parametrize("option,package", [("logging.tensorboard=true", "tensorboard"),
                                            ("logging.wandb.enabled=true", "wandb")])
def test_missing_package_is_one_line_before_anything_starts(tmp_path, option, package):
    run_dir = tmp_path / "run"
    code = (f"import sys; sys.modules[{package!r}] = None; from pipeline.cli import main;"
            f" sys.exit(main(['run', 'configs/tiny.yaml', 'run_dir={run_dir}', {option!r}]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"lockstep: error: {option} needs the {package} package, which is not installed:"
        " pip install lockstep[tracking] (or set it to false)"]
    assert not run_dir.exists()  # refused before the run directory was made
