"""`lockstep eval RUN_DIR|MODEL_DIR`: evaluate a model on held-out sets on its own, outside a run.

A run directory contributes its resolved config (data keys, reward functions, eval.* settings, engine
settings) and its exported model (hf/); a bare Hugging Face directory the defaults. `--dataset
name=path` replaces eval.datasets; `key.sub=value` overrides the rest. The engine is started as a run
starts one (the same component entry point, a scratch run directory for its config, token and
rendezvous), the sets are evaluated by the rollout side's Evaluator, and the results are written as
in a run: <name>.jsonl per set and summary.json, in RUN_DIR/eval/hf/ or --out.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

from pipeline.config import config_from_dict, dump_config
from pipeline.config.core import apply_overrides, load_yaml
from pipeline.config.schema import RunConfig
from pipeline.errors import ConfigError, UserError
from pipeline.run import EvalDir, RunDir


def eval_config(target: str, datasets: list[str], overrides: list[str]) -> tuple[RunConfig, str, EvalDir | None, int]:
    """(config, model directory, default output, step the weights stand for) of `lockstep eval TARGET`."""
    rundir = RunDir(target)
    if os.path.isfile(rundir.config):
        model_dir = rundir.hf_export
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise UserError(f"{target} has no exported model (hf/): the run has not finished, or ran with"
                            " checkpoint.export_hf=false; give the model directory instead")
        data, out = load_yaml(rundir.config), rundir.eval_hf
    elif os.path.isfile(os.path.join(target, "config.json")):
        model_dir, data, out = target, {}, None
    else:
        raise UserError(f"{target!r} is neither a run directory (config.yaml) nor a Hugging Face model directory"
                        " (config.json)")
    data = apply_overrides(RunConfig, data, overrides)
    data["model"] = dict(data.get("model") or {}, path=os.path.abspath(model_dir))
    ev = dict(data.get("eval") or {}, interval=0)
    if datasets:
        ev["datasets"] = dict(parse_dataset(d) for d in datasets)
    if not ev.get("datasets"):
        raise UserError("nothing to evaluate: give --dataset NAME=PATH (or a run directory whose config has"
                        " eval.datasets)")
    rollout = dict(data.get("rollout") or {})
    if ev.get("max_response_len"):  # the engine's context is sized by the rollout's length: make room
        rollout["rollout_max_response_len"] = max(int(ev["max_response_len"]), rollout.get("rollout_max_response_len", 0))
    data.update(eval=ev, rollout=rollout)
    cfg = config_from_dict(data)
    datasets_abs = {n: dataclasses.replace(d, path=os.path.abspath(os.path.expanduser(d.path)))
                    for n, d in cfg.eval.datasets.items()}
    for name, d in datasets_abs.items():
        if not os.path.isfile(d.path):
            raise UserError(f"eval.datasets.{name} {d.path!r} not found: point it at a JSONL file of prompts")
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, datasets=datasets_abs))
    step = cfg.num_rollout if out is not None else 0  # a run's export: the weights after its last step
    return cfg, model_dir, out, step


def parse_dataset(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--dataset {text!r}: expected NAME=PATH (e.g. --dataset test=data/arith/test.jsonl)")
    return name, path


def run_eval(target: str, datasets: list[str], overrides: list[str], out_dir: str | None) -> tuple[dict, EvalDir]:
    """Start the engine(s), evaluate, stop them; (summary, where the files are)."""
    cfg, model_dir, out, step = eval_config(target, datasets, overrides)
    out = EvalDir(os.path.abspath(out_dir)) if out_dir else out
    if out is None:
        raise UserError("give --out DIR for the results of evaluating a model directory")
    from pipeline.launch.local import Supervisor  # heavy imports (torch) after the instant checks
    from pipeline.launch.prepare import check_weights_present
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.rollout.client import EnginePool
    from pipeline.rollout.eval_data import load_eval_sets
    from pipeline.rollout.evaluation import Evaluator

    from pipeline.models.hf_config import read_model_args

    check_weights_present(model_dir, read_model_args(model_dir))
    tokenizer = load_tokenizer(model_dir)
    sets = load_eval_sets(cfg, tokenizer)  # bad data or reward refused before an engine starts
    scratch = RunDir(tempfile.mkdtemp(prefix="lockstep-eval-"))
    cfg = dataclasses.replace(cfg, run_dir=scratch.root)
    sup = Supervisor(scratch)
    try:
        os.makedirs(scratch.logs)
        with open(scratch.config, "w") as f:
            f.write(dump_config(cfg))
        token = scratch.create_token()
        scratch.reset_control()
        n = cfg.engine.num_engines
        for i in range(n):
            sup.start(f"engine_{i}", ["engine", "--run-dir", scratch.root, "--index", str(i)])
        urls = scratch.engine_urls(n, timeout_s=cfg.engine.startup_timeout_s, alive=sup.check)
        pool = EnginePool(urls, timeout_s=cfg.rollout.request_timeout_s, max_retries=cfg.rollout.max_retries,
                          api_key=token, retry_budget_s=None)
        Evaluator(cfg, tokenizer, pool, sets=sets).evaluate(step, out)
    finally:
        sup.stop_all()
        shutil.rmtree(scratch.root, ignore_errors=True)
    return out.summary(), out
