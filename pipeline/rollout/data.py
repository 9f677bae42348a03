"""The prompt dataset: JSONL rows -> validated, tokenized prompts in a deterministic order.

The order is a pure function of (rollout_seed, step): epoch e is a permutation seeded by
rollout_seed + e, and step k takes the next rollout_batch_size prompts of the endless stream. So the
data cursor never needs saving: a resumed run draws exactly the prompts it would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config.schema import DataConfig
from pipeline.errors import UserError
from pipeline.models.tokenizer import Tokenizer


@dataclass
class Prompt:
    index: int  # row index in the file
    input_ids: list[int]
    label: Any
    metadata: dict = field(default_factory=dict)
    text: str = ""


@dataclass
class DatasetStats:
    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class PromptDataset:
    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seed: int):
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.prompts, self.stats = self._load()
        self._orders: dict[int, np.ndarray] = {}
        if not self.prompts:
            raise UserError(f"{cfg.prompt_data}: no usable rows ({self.stats.skipped or 'file is empty'})")

    def _load(self) -> tuple[list[Prompt], DatasetStats]:
        cfg = self.cfg
        stats = DatasetStats()
        prompts: list[Prompt] = []
        try:
            f = open(cfg.prompt_data)
        except FileNotFoundError:
            raise UserError(f"data.prompt_data {cfg.prompt_data!r} not found") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                stats.rows += 1
                problem, prompt = self._parse(line, len(prompts), lineno)
                if problem:
                    if cfg.on_bad_row == "error":
                        raise UserError(f"{cfg.prompt_data}:{lineno}: {problem} (set data.on_bad_row=skip to skip such rows)")
                    stats.skip(problem.split(":")[0])
                    continue
                prompts.append(prompt)
        stats.kept = len(prompts)
        return prompts, stats

    def _parse(self, line: str, index: int, lineno: int) -> tuple[str | None, Prompt | None]:
        cfg = self.cfg
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return "invalid JSON", None
        if not isinstance(row, dict):
            return "row is not a JSON object", None
        if cfg.input_key not in row:
            return f"missing field {cfg.input_key!r}", None
        raw = row[cfg.input_key]
        if cfg.apply_chat_template:
            messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
            if not (isinstance(messages, list) and all(isinstance(m, dict) and "content" in m for m in messages)):
                return f"field {cfg.input_key!r} is not a string or a list of chat messages", None
            text = self.tokenizer.apply_chat_template(messages)
        else:
            if not isinstance(raw, str):
                return f"field {cfg.input_key!r} is not a string (got {type(raw).__name__})", None
            text = raw
        ids = self.tokenizer.encode(text)
        if not ids:
            return "empty prompt", None
        if len(ids) > cfg.max_prompt_len:
            return f"oversize prompt: {len(ids)} tokens > data.max_prompt_len ({cfg.max_prompt_len})", None
        metadata = row.get(cfg.metadata_key) or {}
        if not isinstance(metadata, dict):
            return f"field {cfg.metadata_key!r} is not an object", None
        return None, Prompt(index=index, input_ids=ids, label=row.get(cfg.label_key), metadata=metadata, text=text)

    def __len__(self) -> int:
        return len(self.prompts)

    def epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.prompts)
        if not self.cfg.rollout_shuffle:
            return np.arange(n)
        return np.random.default_rng(self.seed + epoch).permutation(n)

    def prompt_at(self, draw: int) -> Prompt:
        """The prompt at position `draw` of the endless, epoch-shuffled stream (a pure function)."""
        epoch, i = divmod(draw, len(self.prompts))
        if epoch not in self._orders:
            self._orders = {epoch: self.epoch_order(epoch)}
        return self.prompts[int(self._orders[epoch][i])]

    def batch(self, step: int, batch_size: int) -> list[Prompt]:
        """Prompts of rollout step `step` (a pure function of seed and step)."""
        n = len(self.prompts)
        orders: dict[int, np.ndarray] = {}
        out = []
        for pos in range(step * batch_size, (step + 1) * batch_size):
            epoch, i = divmod(pos, n)
            if epoch not in orders:
                orders[epoch] = self.epoch_order(epoch)
            out.append(self.prompts[int(orders[epoch][i])])
        return out
