"""Configs: every shipped recipe loads; bad input is refused with one line that names the fix."""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sys

import pytest

from pipeline.config import RunConfig, config_from_dict, dump_config, load_config
from pipeline.config.core import field_docs, from_dict, option_table, to_dict
from pipeline.errors import ConfigError

from conftest import REPO


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # A resolved config round-trips through YAML unchanged.
    import yaml

    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg


def test_every_option_is_documented():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring under it"
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                pass
    from pipeline.config import schema

    for name in dir(schema):
        obj = getattr(schema, name)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == schema.__name__:
            walk(obj)
    rows = option_table(RunConfig)
    names = [r[0] for r in rows]
    assert "rollout.rollout_batch_size" in names and "train.max_tokens_per_gpu" in names


def test_overrides_dotted_and_unique_leaf():
    cfg = load_config(None, ["rollout.rollout_batch_size=16", "global_batch_size=64", "train.lr=1e-4",
                             "run_dir=/tmp/x", "eps_clip_high=0.3"])
    assert cfg.rollout.rollout_batch_size == 16 and cfg.train.global_batch_size == 64
    assert cfg.train.lr == 1e-4 and cfg.run_dir == "/tmp/x" and cfg.algo.eps_clip_high == 0.3


def test_miles_names_exist():
    leaves = {r[0].split(".")[-1] for r in option_table(RunConfig)}
    for name in ["rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "rollout_max_response_len",
                 "rollout_temperature", "max_tokens_per_gpu", "advantage_estimator", "eps_clip", "eps_clip_high",
                 "kl_loss_coef", "rollout_seed", "num_rollout"]:
        assert name in leaves, name


@pytest.mark.parametrize("overrides, message", [
    (["rollout_batch_sz=3"], "unknown config key 'rollout_batch_sz' (did you mean 'rollout.rollout_batch_size'?)"),
    (["train.bogus=1"], "unknown config key 'train.bogus'"),
    (["train.lr=fast"], "train.lr: expected a number, got 'fast'"),
    (["rollout.n_samples_per_prompt=2.5"], "rollout.n_samples_per_prompt: expected an integer"),
    (["global_batch_size=7"], "must be divisible by global_batch_size (7)"),
    (["model.init=tiny-huge"], "'tiny-huge' is not one of"),
    (["max_tokens_per_gpu=16"], "max_tokens_per_gpu (16) <"),
    (["device=cpu"], "ambiguous"),
    (["rollout_top_p=1.5"], "rollout_top_p must be in (0, 1]"),
    (["train.compile=true", "determinism.true_on_policy=true"], "train.compile and determinism.true_on_policy exclude"),
    (["train.compile=true", "train.backend=megatron"], "set train.backend=fsdp"),
    # values torch or the trainer would only refuse after start-up (or take silently and train on NaN)
    (["train.lr=.nan"], "train.lr must be > 0 (got nan)"),
    (["train.lr=.inf"], "train.lr (got inf): every number must be finite"),
    (["algo.kl_loss_coef=.nan"], "algo.kl_loss_coef (got nan): every number must be finite"),
    (["rollout.rollout_temperature=.nan"], "rollout.rollout_temperature must be > 0"),
    (["train.num_threads=0"], "train.num_threads must be > 0"),
    (["engine.num_threads=-1"], "engine.num_threads must be > 0"),
    (["train.weight_decay=-1"], "train.weight_decay must be >= 0"),
    (["train.adam_eps=0"], "train.adam_eps must be > 0"),
    (["train.adam_beta2=1"], "train.adam_beta1 and train.adam_beta2 must be in [0, 1)"),
    (["train.dist_timeout_s=0"], "train.dist_timeout_s must be > 0"),
    (["train.lr_warmup_steps=-5"], "train.lr_warmup_steps must be >= 0"),
    (["rollout.max_draws_per_step=0"], "rollout.max_draws_per_step must be > 0"),
    (["rollout.max_retries=-1"], "rollout.max_retries must be >= 0"),
    (["engine.max_restarts=-1"], "engine.max_restarts must be >= 0"),
    (["determinism.true_on_policy=true", "rollout.mode=one_step_off"], "determinism.true_on_policy needs rollout.mode=sync"),
    (["determinism.true_on_policy=true", "rollout.mode=fully_async"], "determinism.true_on_policy needs rollout.mode=sync"),
])
def test_bad_config_messages(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_to_dict_from_dict_roundtrip():
    cfg = RunConfig()
    assert from_dict(RunConfig, to_dict(cfg)) == cfg


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, fragment", [
    (["run", "configs/tiny.yaml", "rollout.rollout_batch_sz=3"], "unknown config key"),
    (["run", "configs/tiny.yaml", "train.lr=abc"], "expected a number"),
    (["run", "configs/tiny.yaml", "global_batch_size=100"], "divisible by global_batch_size"),
    (["run", "configs/missing.yaml"], "not found"),
    (["run", "configs/tiny.yaml", "data.prompt_data=/nonexistent.jsonl"], "data.prompt_data '/nonexistent.jsonl' not found"),
    (["run", "configs/tiny.yaml", "model.path=/nonexistent_model"], "model.path '/nonexistent_model' is not a directory"),
    (["run", "configs/tiny.yaml", "train.int4_qat=true"], "int4_qat quantizes MoE expert weights"),  # validate.py
])
def test_cli_bad_input_is_one_line_without_traceback(args, fragment, tmp_path):
    res = run_cli(*args, f"run_dir={tmp_path}/run")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lockstep: error:") and fragment in lines[0], res.stderr


def test_cli_dataset_without_prompt_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1=", "label": "2"}\n')
    res = run_cli("run", "configs/tiny.yaml", f"data.prompt_data={bad}", f"run_dir={tmp_path}/run")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "no 'prompt' field (1: line 1)) (set data.input_key to the field that holds the prompt)" in res.stderr


def test_cli_bad_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout: [unclosed\n")
    res = run_cli("run", str(p))
    assert res.returncode == 2 and "not valid YAML" in res.stderr and "Traceback" not in res.stderr


def test_config_options_lists_everything():
    res = run_cli("config", "options")
    assert res.returncode == 0
    assert "rollout.rollout_batch_size" in res.stdout and "Miles: --rollout-batch-size" in res.stdout


# ---- checks against the model's shape (pipeline/config/validate.py) -------------------------------
def _args(preset: str, **changes):
    from pipeline.config.memory import model_args

    return dataclasses.replace(model_args(load_config(None, [f"model.init={preset}"])), **changes)


THREE_RANKS = ["train.num_gpus=3", "train.global_batch_size=3", "rollout.rollout_batch_size=3",
               "rollout.n_samples_per_prompt=1", "algo.advantage_estimator=reinforce_plus_plus"]


@pytest.mark.parametrize("preset, changes, overrides, message", [
    ("tiny-dense", {}, ["train.int4_qat=true"], "int4_qat quantizes MoE expert weights"),
    ("tiny-moe", {}, ["train.int4_qat=true", "train.int4_group_size=48"], "int4_group_size (48) does not divide"),
    ("tiny-moe", {}, ["train.compile=true"], "train.compile is for dense models"),
    ("tiny-dense", {"mlp_bias": True}, ["train.backend=megatron"], "does not support mlp_bias=true"),
    ("tiny-dense", {}, ["train.backend=megatron", *THREE_RANKS,
                        "train.tensor_model_parallel_size=3"], "num_key_value_heads (2) must be divisible by tensor"),
    ("tiny-dense", {}, ["train.backend=megatron", "train.num_gpus=2", "train.expert_model_parallel_size=2"],
     "expert parallelism needs a MoE model"),
    ("tiny-dense", {}, ["train.backend=megatron", "train.num_gpus=4", "train.pipeline_model_parallel_size=4"],
     "num_hidden_layers (2) must be divisible by pipeline parallel size 4"),
    ("tiny-moe", {}, ["train.backend=megatron", *THREE_RANKS,
                      "train.expert_model_parallel_size=3"], "num_experts (8) must be divisible by expert parallel"),
    ("tiny-moe", {}, ["train.backend=megatron", "determinism.true_on_policy=true"], "dense models only"),
    ("tiny-moe", {}, ["train.backend=megatron", "train.num_gpus=2", "train.tensor_model_parallel_size=2"],
     "set train.sequence_parallel=true"),
    ("tiny-moe", {"decoder_sparse_step": 2}, ["train.backend=megatron"], "whose every layer is MoE"),
])
def test_validate_refuses_what_the_model_cannot_do(preset, changes, overrides, message):
    from pipeline.config.validate import validate

    cfg = load_config(None, [f"model.init={preset}", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, _args(preset, **changes))
    assert message in str(e.value)


def test_validate_accepts_what_runs():
    from pipeline.config.validate import validate

    for preset, overrides in (("tiny-dense", []), ("tiny-moe", ["train.int4_qat=true"]),
                              ("tiny-moe", ["train.backend=megatron", "train.num_gpus=2", "train.tensor_model_parallel_size=2",
                                            "train.sequence_parallel=true"]),
                              ("tiny-moe", ["train.backend=megatron", "train.num_gpus=2",
                                            "train.expert_model_parallel_size=2", "train.int4_qat=true"])):
        validate(load_config(None, [f"model.init={preset}", *overrides]), _args(preset))


def test_config_package_imports_no_trainer_and_no_torch():
    code = ("import sys, pipeline.config, pipeline.config.validate, pipeline.config.memory;"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('pipeline.trainer')]; print(bad)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_paths_of_the_wrong_kind_are_one_line_each(tmp_path):
    """A directory where a file belongs, a file where a directory belongs, a missing run directory, a
    config file in another encoding: one line each (they were tracebacks, or "OK: 0 steps checked")."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"run_dir: \xff\xfe x\n")
    for args, fragment in [
            (["run", "configs"], "config file 'configs' is a directory"),
            (["config", "show", str(latin)], "is not UTF-8 text"),
            (["status", str(tmp_path / "nope")], "is not found: give a run directory"),
            (["summary", str(afile)], "is a file: give a run directory"),
            (["buffer", "verify", str(tmp_path / "nope")], "is not found: give a run directory"),
            (["nightly", "report", str(tmp_path / "nope")], "is not found: give the matrix's out_dir"),
            (["data", "make-arith", str(afile)], "is a file: give a directory"),
            (["run", "configs/tiny.yaml", f"run_dir={tmp_path}/r", "rollout.rm_type=http://127.0.0.1:1/reward"],
             "a reward server is written remote:URL")]:
        res = run_cli(*args)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr[-1500:])
        assert len(lines) == 1 and fragment in lines[0], (args, res.stderr)
