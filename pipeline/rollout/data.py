"""The prompt dataset: JSONL rows -> validated, tokenized prompts in a deterministic order.

The order is a pure function of (rollout_seed, step): epoch e is a permutation seeded by
rollout_seed + e, and step k takes the next rollout_batch_size prompts of the endless stream. So the
data cursor never needs saving: a resumed run draws exactly the prompts it would have drawn.
"""

from __future__ import annotations

import json
import os
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


MISSING = object()


def field_at(row: dict, key: str):
    """row[key], where a dotted key walks nested objects (`a.b` is row["a"]["b"], as Miles allows); a key
    present as written wins over the dotted walk. MISSING when absent."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def parse_row(line: str, input_key: str) -> tuple[str | None, dict | None, Any]:
    """(why the JSONL line is unusable, or None; the row; its `input_key` field). The reasons are short
    and fixed: they are counted per reason."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return "invalid JSON", None, MISSING
    if not isinstance(row, dict):
        return "row is not a JSON object", None, MISSING
    raw = field_at(row, input_key)
    if raw is MISSING:
        return f"no {input_key!r} field", None, MISSING
    return None, row, raw


PARQUET_MAGIC = b"PAR1"


def read_lines(path: str, what: str = "data.prompt_data"):
    """(line number, JSON text) of each non-blank row of a JSONL file, or of each record of a Parquet file
    (Miles / slime data; needs pyarrow: `pip install pyarrow`). One-line UserErrors for what is not such a
    file: a directory, a missing file, bytes that are not UTF-8 (a JSON array reads as rows that fail to
    parse: PromptDataset's hint names it)."""
    if os.path.isdir(path):
        raise UserError(f"{what} {path!r} is a directory: point it at a JSONL (or Parquet) file")
    try:
        f = open(path, "rb")  # decoded line by line: a bad byte is reported at its line
    except FileNotFoundError:
        raise UserError(f"{what} {path!r} not found") from None
    with f:
        if f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            yield from _parquet_lines(path, what)
            return
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is not part of the row
            except UnicodeDecodeError as e:
                raise UserError(f"{what} {path!r}: line {lineno} is not UTF-8 text ({e.reason} at byte {e.start} of"
                                " the line): Lockstep reads JSONL, one JSON object per line, in UTF-8") from None
            if line.strip():
                yield lineno, line


def _parquet_lines(path: str, what: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{what} {path!r} is a Parquet file: reading it needs pyarrow (pip install pyarrow),"
                        " or convert it to JSONL") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors are many; any of them means an unreadable file
        raise UserError(f"{what} {path!r}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for i, record in enumerate(table.to_pylist(), 1):
        yield i, json.dumps(record, default=str)


def is_chat(value) -> bool:
    """A list of chat messages ({"role", "content"} objects)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def text_messages(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """(why they cannot be read, or None; the messages with each content a string). A content given as a
    list of parts (the OpenAI form: {"type": "text", "text": ...}, or bare strings) becomes its text parts
    joined by newlines, as vLLM does for a text-only chat template: most such templates would otherwise
    print the list's repr or drop it. Other parts (images, audio) are refused: Lockstep trains text models.
    A None content (an assistant turn with tool calls only) stays None."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    kind, text = "text", part
                elif isinstance(part, dict):
                    kind, text = part.get("type", "text"), part.get("text")
                else:
                    kind = text = None
                if not isinstance(kind, str):
                    return "a message's content list holds something other than parts", messages
                if kind != "text" or not isinstance(text, str):
                    return f"a message has a {kind!r} content part (only text parts are read)", messages
                texts.append(text)
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            return "a message's content is neither text nor a list of parts", messages
        out.append(m)
    return None, out


@dataclass
class DatasetStats:
    """What loading a prompt file kept and skipped: a count per reason and the first lines of each."""

    path: str = ""
    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason -> first line numbers
    starts_with_array: bool = False  # the first row begins with "[": a JSON array, not JSONL
    unknown: int = 0  # kept rows holding text the tokenizer reads as its unknown token
    unknown_lines: list[int] = field(default_factory=list)  # the first of them

    def skip(self, reason: str, lineno: int) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        lines = self.examples.setdefault(reason, [])
        if len(lines) < 3:
            lines.append(lineno)

    def report(self) -> str:
        """`data: 998 of 1000 rows of train.jsonl kept; skipped 2: invalid JSON (2: lines 4, 9)`."""
        head = f"data: {self.kept} of {self.rows} rows of {self.path} kept"
        if self.unknown:
            lines = ", ".join(map(str, self.unknown_lines)) + (", ..." if self.unknown > len(self.unknown_lines) else "")
            head += (f" ({self.unknown} of them hold characters the tokenizer does not know, read as its unknown"
                     f" token: line{'s' if self.unknown > 1 else ''} {lines})")
        if not self.skipped:
            return head
        reasons = "; ".join(f"{reason} ({n}: line{'s' if n > 1 else ''} {', '.join(map(str, self.examples[reason]))}"
                            f"{', ...' if n > len(self.examples[reason]) else ''})" for reason, n in self.skipped.items())
        return f"{head}; skipped {sum(self.skipped.values())}: {reasons}"


class PromptDataset:
    """`label_for`: the reward function's name when it compares the response with the row's label (a
    built-in one): a row without data.label_key is then unusable, not a prompt rewarded 0 every time.
    `what`: the option that named the file, in every error (data.prompt_data, or eval.datasets.<name>,
    whose input_key / label_key the hints then name)."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seed: int, label_for: str | None = None,
                 what: str = "data.prompt_data"):
        self.cfg, self.tokenizer, self.seed, self.label_for, self.what = cfg, tokenizer, seed, label_for, what
        self.prompts, self.stats = self._load()
        self._orders: dict[int, np.ndarray] = {}
        if not self.prompts:
            keys = what.removesuffix(".prompt_data")  # the section of input_key / label_key
            hint = (f" (set {keys}.input_key to the field that holds the prompt)"
                    if f"no {cfg.input_key!r} field" in self.stats.skipped else
                    f" (set {keys}.label_key to the field that holds the answer)"
                    if any(r.startswith(f"no {cfg.label_key!r} field") for r in self.stats.skipped) else
                    " (Lockstep reads JSONL: one JSON object per line, not a JSON array)"
                    if self.stats.starts_with_array else "")
            raise UserError(f"{what} {cfg.prompt_data!r}: no usable rows"
                            f" ({self.stats.report() if self.stats.rows else 'file is empty'})" + hint)

    def _load(self) -> tuple[list[Prompt], DatasetStats]:
        cfg = self.cfg
        stats = DatasetStats(path=cfg.prompt_data)
        prompts: list[Prompt] = []
        for lineno, line in read_lines(cfg.prompt_data, self.what):
            if stats.rows == 0:
                stats.starts_with_array = line.lstrip().startswith("[")
            stats.rows += 1
            problem, prompt = self._parse(line, len(prompts))
            if problem:
                if cfg.on_bad_row == "error":
                    raise UserError(f"{self.what} {cfg.prompt_data}:{lineno}: {problem} (set data.on_bad_row=skip to"
                                    " skip such rows)")
                stats.skip(problem, lineno)
                continue
            prompts.append(prompt)
            unk = self.tokenizer.unk_token_id
            if unk is not None and unk in self._ids(prompt):
                stats.unknown += 1
                if len(stats.unknown_lines) < 3:
                    stats.unknown_lines.append(lineno)
        stats.kept = len(prompts)
        return prompts, stats

    def _parse(self, line: str, index: int) -> tuple[str | None, Prompt | None]:
        """(why the row is unusable, or None; the prompt). Reasons are short and fixed (they are counted)."""
        cfg = self.cfg
        problem, row, raw = parse_row(line, cfg.input_key)
        if problem:
            return problem, None
        if is_chat(raw):
            problem, raw = text_messages(raw)
            if problem:
                return problem, None
        if is_chat(raw) or (cfg.apply_chat_template and isinstance(raw, str)):
            if not self.tokenizer.chat_template:
                return "chat messages, but the tokenizer has no chat template", None
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": raw}] if isinstance(raw, str) else raw)
        elif isinstance(raw, str):
            text = raw
        else:
            return f"{cfg.input_key!r} is neither text nor a list of chat messages", None
        ids = self.tokenizer.encode(text)
        if not ids:
            return "empty prompt", None
        if len(ids) > cfg.max_prompt_len:
            return f"prompt longer than data.max_prompt_len ({cfg.max_prompt_len} tokens)", None
        metadata = field_at(row, cfg.metadata_key)
        metadata = {} if metadata is MISSING or metadata is None else metadata
        if not isinstance(metadata, dict):
            return f"{cfg.metadata_key!r} is not an object", None
        label = field_at(row, cfg.label_key)
        if self.label_for and (label is MISSING or label is None):
            return f"no {cfg.label_key!r} field (rm_type {self.label_for} compares the response with it)", None
        return None, Prompt(index=index, input_ids=ids, label=None if label is MISSING else label,
                            metadata=metadata, text=text)

    def _ids(self, prompt: Prompt) -> list[int]:
        """The token ids a kept row became (checked for the unknown token)."""
        return prompt.input_ids

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
