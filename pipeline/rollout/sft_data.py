"""The supervised dataset (algo.loss_type=sft_loss): JSONL rows -> tokenized prompt/response examples,
and each step's batch, built straight from the file (no engines, no rollout buffer).

A row is a prompt (data.input_key: text, or chat messages) with a response (data.response_key: text),
or chat messages alone, whose assistant turns are the targets. Tokens: the prompt, then the response
region (from the first target token to the end); loss mask 1 on target tokens only, so in a
multi-turn conversation the later user turns sit in the response region with mask 0. The trainer
scores only the response region: prompt tokens are never targets.

  text prompt + response    prompt ids | response ids + end-of-text          (mask 1 on the response)
  chat messages (+ response) rendered turn by turn with the tokenizer's chat template: what precedes
                            an assistant turn (its generation prompt included) has mask 0, the turn
                            itself (content and end-of-turn) mask 1

Order: the endless stream of epochs of PromptDataset (each a permutation seeded by rollout_seed +
epoch, data.rollout_shuffle); a step takes the next rollout_batch_size rows from a cursor that the
trainer keeps in its checkpoints, so a resumed run continues mid-epoch exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.buffer.schema import RolloutBatch, Sample
from pipeline.config.schema import DataConfig
from pipeline.models.tokenizer import Tokenizer
from pipeline.rollout.data import MISSING, PromptDataset, field_at, is_chat, parse_row, text_messages


@dataclass
class SftExample:
    index: int  # position among the kept rows
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # one per response token: 1 = a target


def chat_segments(tok: Tokenizer, messages: list[dict]) -> list[tuple[list[int], bool]] | str:
    """A conversation up to its last assistant turn as token segments, each with whether it is a target
    (an assistant turn: content and end-of-turn); or why it cannot be split. Each turn is rendered with
    the chat template on top of the ones before (the prompt as an engine would get it, with the
    generation prompt); a template that rewrites earlier turns (e.g. drops past reasoning) cannot be."""
    if not tok.chat_template:
        return "chat messages, but the tokenizer has no chat template"
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return "chat messages without an assistant turn"
    texts: list[tuple[str, bool]] = []
    done = ""
    for i in range(last + 1):
        if messages[i]["role"] != "assistant":
            continue
        if not isinstance(messages[i]["content"], str) or not tok.encode(messages[i]["content"]):
            return "empty response"
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True)
        full = tok.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(done) or not full.startswith(before):
            return "the chat template does not render turns incrementally"
        texts += [(before[len(done):], False), (full[len(before):], True)]
        done = full
    return [(tok.encode(text), target) for text, target in texts if text]


class SftDataset(PromptDataset):
    """The rows of data.prompt_data as SftExamples (`self.prompts`), in PromptDataset's shuffled order.
    `max_len`: the most tokens of prompt + response (data.max_prompt_len + rollout.rollout_max_response_len)."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seed: int, max_len: int):
        self.max_len = max_len
        super().__init__(cfg, tokenizer, seed)

    def _parse(self, line: str, index: int) -> tuple[str | None, SftExample | None]:
        """(why the row is unusable, or None; the example). Reasons are short and fixed (they are counted)."""
        cfg, tok = self.cfg, self.tokenizer
        problem, row, raw = parse_row(line, cfg.input_key)
        if problem:
            return problem, None
        response = field_at(row, cfg.response_key)
        if response is MISSING and not is_chat(raw):
            return f"no {cfg.response_key!r} field (nor chat messages with assistant turns)", None
        if response is not MISSING and not isinstance(response, str):
            return f"{cfg.response_key!r} is not text", None
        if not (is_chat(raw) or isinstance(raw, str)):
            return f"{cfg.input_key!r} is neither text nor a list of chat messages", None
        if isinstance(raw, str) and not cfg.apply_chat_template:
            prompt_ids, response_ids = tok.encode(raw), tok.encode(response)
            if not prompt_ids:
                return "empty prompt", None
            if not response_ids:
                return "empty response", None
            return self._fit(index, prompt_ids, response_ids + [tok.eos_token_id], [1] * (len(response_ids) + 1))
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        problem, messages = text_messages(messages)
        if problem:
            return problem, None
        if response is not MISSING:
            messages.append({"role": "assistant", "content": response})
        segments = chat_segments(tok, messages)
        if isinstance(segments, str):
            return segments, None
        if segments[0][1]:
            return "empty prompt", None
        prompt_ids = segments[0][0]
        response_ids = [t for ids, _ in segments[1:] for t in ids]
        mask = [int(target) for ids, target in segments[1:] for _ in ids]
        return self._fit(index, prompt_ids, response_ids, mask)

    def _ids(self, ex: SftExample) -> list[int]:
        return ex.prompt_ids + ex.response_ids

    def _fit(self, index: int, prompt_ids: list[int], response_ids: list[int], mask: list[int]):
        if len(prompt_ids) + len(response_ids) > self.max_len:
            return (f"prompt+response longer than data.max_prompt_len + rollout.rollout_max_response_len"
                    f" ({self.max_len} tokens)"), None
        return None, SftExample(index, prompt_ids, response_ids, mask)

    def batch_at(self, cursor: int, size: int) -> RolloutBatch:
        """Rows cursor .. cursor+size-1 of the endless shuffled stream, as a batch the trainer plans and
        packs like rollouts (one sample per row; no engine logprobs, no rewards)."""
        samples = []
        for pos in range(cursor, cursor + size):
            ex: SftExample = self.prompt_at(pos)
            samples.append(Sample(group_id=pos, sample_idx=0, prompt_idx=ex.index, prompt_ids=ex.prompt_ids,
                                  response_ids=ex.response_ids, logprobs=[0.0] * len(ex.response_ids),
                                  loss_mask=ex.loss_mask))
        return RolloutBatch.from_samples(samples)
