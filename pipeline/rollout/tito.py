"""TITO (token in, token out): compare the token sequence that was generated with the one trained on.

Lockstep never decodes and re-encodes a response, so generated == trained by construction; these
checks make that visible and catch the three ways it breaks in pipelines that do go through text:
  - retokenize drift: encode(prompt text + decode(response)) != prompt ids + response ids (merges
    across the boundary, normalisation, lost special tokens);
  - alternate EOS: the response ends in an end token other than the one training expects (e.g.
    <|endoftext|> where the chat template closes turns with <|im_end|>);
  - special tokens inside a response (a template marker generated mid-answer).
The rollout manager reports their frequencies (rollout/tito_*); every sample carries a hash of its
generated tokens that the trainer checks against what it trains on (train/tito_mismatch must be 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash


def token_hash(ids) -> str:
    return xxhash.xxh3_64_hexdigest(",".join(map(str, ids)).encode())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class TitoReport:
    issues: list[str] = field(default_factory=list)
    divergence: int | None = None  # token index in prompt+response where re-encoding first differs

    @property
    def ok(self) -> bool:
        return not self.issues


def check_sample(prompt_ids: list[int], response_ids: list[int], tokenizer, expected_eos: list[int],
                 prompt_text: str | None = None) -> TitoReport:
    """TITO checks of one sample (see module docstring)."""
    report = TitoReport()
    special = set(tokenizer.special_ids)
    eos_like = special & {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "</s>", "<|eot_id|>")}
    if response_ids and response_ids[-1] in eos_like and response_ids[-1] not in expected_eos:
        report.issues.append("alternate_eos")
    if any(t in special for t in response_ids[:-1]):
        report.issues.append("special_token_in_response")
    if prompt_text is not None:
        text = prompt_text + tokenizer.decode(response_ids, skip_special_tokens=False)
        reencoded = tokenizer.encode(text)
        report.divergence = first_divergence(reencoded, list(prompt_ids) + list(response_ids))
        if report.divergence is not None:
            report.issues.append("retokenize_drift")
    return report


def verify_batch(batch) -> int:
    """Samples of a RolloutBatch whose tokens no longer hash to what the engine generated."""
    import json

    bad = 0
    for i, meta in enumerate(batch.metadata):
        expected = json.loads(meta).get("token_hash") if meta else None
        if expected is not None and token_hash(batch.sequence(i).tolist()) != expected:
            bad += 1
    return bad


@dataclass
class TurnCheck:
    """A trajectory compared with what the engine consumed and produced, call by call (expected all 0)."""

    input_mismatches: int = 0  # calls whose input is not a prefix of the final ids (history re-tokenized)
    output_mismatches: int = 0  # calls whose output ids are not, in place, in the final ids (decode/re-encode)
    mask_mismatches: int = 0  # tokens whose loss mask says generated and no call produced them, or vice versa
    logprob_mismatches: int = 0  # generated tokens whose logprob is not the engine's

    @property
    def total(self) -> int:
        return self.input_mismatches + self.output_mismatches + self.mask_mismatches + self.logprob_mismatches


def compare_calls(tokens: list[int], prompt_len: int, loss_mask: list[int], logprobs: list[float],
                  calls) -> TurnCheck:
    """TITO across turns: the final ids against every engine call (pipeline/rollout/trajectory.Call)."""
    check = TurnCheck()
    generated = [0] * len(tokens)
    for c in calls:
        a, b = c.span
        if list(tokens[:a]) != list(c.input_ids):
            check.input_mismatches += 1
        if list(tokens[a:b]) != list(c.output_ids):
            check.output_mismatches += 1
            continue
        for j in range(a, b):
            generated[j] = 1
        if [float(x) for x in logprobs[a - prompt_len: b - prompt_len]] != [float(x) for x in c.logprobs]:
            check.logprob_mismatches += 1
    check.mask_mismatches = sum(int(m != 0) != g for m, g in zip(loss_mask, generated[prompt_len:]))
    return check


def check_turns(prompt_ids: list[int], response_ids: list[int], turn_spans: list[tuple[int, int]], tokenizer,
                expected_eos: list[int], prompt_text: str | None = None) -> TitoReport:
    """check_sample for a multi-turn sample: alternate EOS and special tokens are looked for in the generated
    spans only (environment spans carry template delimiters by design); drift over the whole sequence (what
    a pipeline that went through text would have trained on)."""
    report = check_sample(prompt_ids, response_ids, tokenizer, expected_eos, prompt_text)
    report.issues = [i for i in report.issues if i == "retokenize_drift"]
    seq = list(prompt_ids) + list(response_ids)
    for a, b in turn_spans:
        sub = check_sample([], seq[a:b], tokenizer, expected_eos + [seq[b - 1]] * (b < len(seq)))
        report.issues += [i for i in sub.issues if i not in report.issues]
    return report
