"""TITO checks: what is trained on is what was generated; drift of text round trips is caught."""

from __future__ import annotations

from pipeline.buffer.schema import RolloutBatch, Sample
from pipeline.models.tokenizer import load_tokenizer
from pipeline.rollout.tito import check_sample, first_divergence, token_hash, verify_batch


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_checks_catch_alternate_eos_special_tokens_and_drift(dense_dir):
    tok = load_tokenizer(dense_dir)
    eos, im_end, im_start = tok.eos_token_id, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    prompt = "3+4="
    p = tok.encode(prompt)
    clean = check_sample(p, tok.encode("7") + [eos], tok, [eos], prompt)
    assert clean.ok, clean.issues
    assert check_sample(p, tok.encode("7") + [im_end], tok, [eos], prompt).issues == ["alternate_eos"]
    assert "special_token_in_response" in check_sample(p, [im_start] + tok.encode("7") + [eos], tok, [eos], prompt).issues


def test_retokenize_drift_with_bpe_merges(tmp_path):
    """A model may emit 'a' 'b' as two tokens; re-encoding the text merges them into 'ab'."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, models

    from pipeline.models.tokenizer import Tokenizer

    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "=": 4}
    backend = HFTokenizer(models.BPE(vocab, [("a", "b")]))
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok = Tokenizer(backend=backend, eos_token_id=0, pad_token_id=0)
    p = tok.encode("a=")
    assert check_sample(p, [3, 0], tok, [0], "a=").ok
    drift = check_sample(p, [1, 2, 0], tok, [0], "a=")
    assert drift.issues == ["retokenize_drift"] and drift.divergence == len(p)


def test_verify_batch_detects_changed_tokens():
    s = Sample(0, 0, 0, [5, 6], [7, 8], [-0.1, -0.2], metadata={"token_hash": token_hash([5, 6, 7, 8])})
    batch = RolloutBatch.from_samples([s])
    assert verify_batch(batch) == 0
    batch.tokens[-1] = 9
    assert verify_batch(batch) == 1
