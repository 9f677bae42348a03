"""Eval sets: eval.datasets' JSONL files read as the training prompts are (data.* keys unless a set
names its own input_key / label_key, the same parsing and tokenization, data.on_bad_row), each with
its reward function. No torch: the launcher checks them before anything starts
(pipeline/launch/prepare.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config.schema import RunConfig
from pipeline.models.tokenizer import Tokenizer
from pipeline.rollout.data import DatasetStats, Prompt, PromptDataset
from pipeline.rollout.rewards import RewardFn, label_for, resolve_reward


@dataclass
class EvalSet:
    name: str
    prompts: list[Prompt]
    reward_fn: RewardFn
    stats: DatasetStats


def load_eval_sets(cfg: RunConfig, tokenizer: Tokenizer) -> list[EvalSet]:
    """Every eval.datasets entry, parsed and tokenized as training prompts are (data.*, its own input_key
    and label_key when it names them): a missing or empty file, or data.on_bad_row=error on a bad row,
    raises UserError naming it."""
    sets = []
    for name, ds in cfg.eval.datasets.items():
        what = f"eval.datasets.{name}"
        data = dataclasses.replace(cfg.data, prompt_data=ds.path, rollout_shuffle=False,
                                   input_key=cfg.data.input_key if ds.input_key is None else ds.input_key,
                                   label_key=cfg.data.label_key if ds.label_key is None else ds.label_key)
        rm_type = ds.rm_type or cfg.rollout.rm_type
        reward_fn = resolve_reward(rm_type, f"{what}.rm_type" if ds.rm_type else "rollout.rm_type")
        dataset = PromptDataset(data, tokenizer, seed=cfg.rollout.rollout_seed, label_for=label_for(rm_type), what=what)
        prompts = dataset.prompts[:cfg.eval.max_prompts] if cfg.eval.max_prompts else dataset.prompts
        sets.append(EvalSet(name, prompts, reward_fn, dataset.stats))
    return sets
