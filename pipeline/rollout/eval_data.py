"""Eval sets: eval.datasets' JSONL files read as the training prompts are (data.* keys, the same
parsing and tokenization, data.on_bad_row), each with its reward function. No torch: the launcher
checks them before anything starts (pipeline/launch/prepare.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config.schema import RunConfig
from pipeline.errors import UserError
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
    """Every eval.datasets entry, parsed and tokenized as training prompts are (data.*): a missing or
    empty file, or data.on_bad_row=error on a bad row, raises UserError naming it."""
    sets = []
    for name, ds in cfg.eval.datasets.items():
        data = dataclasses.replace(cfg.data, prompt_data=ds.path, rollout_shuffle=False)
        rm_type = ds.rm_type or cfg.rollout.rm_type
        try:
            reward_fn = resolve_reward(rm_type)
            dataset = PromptDataset(data, tokenizer, seed=cfg.rollout.rollout_seed, label_for=label_for(rm_type))
        except UserError as e:
            msg = str(e).replace("data.prompt_data ", "")
            msg = msg.replace("rollout.rm_type", "rm_type") if ds.rm_type else msg
            raise UserError(f"eval.datasets.{name}: {msg}") from None
        prompts = dataset.prompts[:cfg.eval.max_prompts] if cfg.eval.max_prompts else dataset.prompts
        sets.append(EvalSet(name, prompts, reward_fn, dataset.stats))
    return sets
