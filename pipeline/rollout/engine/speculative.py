"""Speculative decoding with the MTP draft head: draft k tokens, verify them in one target forward.

Exact acceptance by shared noise. The engine samples a token as argmax(logits / T + g), where the
Gumbel noise g is a pure function of (request seed, output position, vocab id) (sampling.py). The
draft head samples its guesses with the same noise at the same positions; the target then samples
every verified position with it, and a guess is kept while it equals the target's own token. The
first difference is replaced by the target's token. So the tokens out are, by construction, the
tokens plain decoding would produce from the same target logits: the same distribution always, and
bit-identical tokens and logprobs when the kernels are batch invariant (true on-policy mode), where a
position's logits do not depend on how many tokens share the forward.

The draft head's row i reads the target's hidden state at position i and token i+1 (mtp.py). Each
request keeps the target hidden states of positions whose next token is known but which the head
has not yet seen (`Request.spec_hidden`, from `spec_start`); a round first runs the head over them
(writing its KV cache, one layer, slots paired with the target's), which drafts the first guess, then
drafts the rest one row at a time from its own hidden states. Positions past the accepted tokens
hold stale keys in both caches; they are never attended (queries see positions <= their own) and
are overwritten by the next round.

Legend: B running requests, k drafted tokens per request this round, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses

import torch

from pipeline.models.logprobs import token_logprobs
from pipeline.rollout.engine.kv_cache import CacheAttention, make_cache
from pipeline.rollout.engine.sampling import sample, sampling_rows


def accepted_prefix(draft_Bk: torch.Tensor, target_BK: torch.Tensor) -> torch.Tensor:
    """Drafts kept per row: the length of the leading run where draft j equals target token j.
    target has k+1 columns (the last one follows a fully accepted draft)."""
    k = draft_Bk.shape[1]
    same = (draft_Bk == target_BK[:, :k]).to(torch.int64)
    return same.cumprod(-1).sum(-1)


class SpecDecoder:
    """The speculative decode step of an Engine (engine.speculative_algorithm=NEXTN)."""

    def __init__(self, engine, num_steps: int):
        if not getattr(engine.model, "mtp", None):
            raise ValueError("speculative decoding needs a model with an MTP head (model.mtp_num_layers=1)")
        self.engine, self.k = engine, num_steps
        args = dataclasses.replace(engine.args, num_hidden_layers=1)
        self.cache = make_cache(args, engine.max_running, engine.context_length, engine.dtype, engine.device)
        s = engine.stats
        s.update(spec_rounds=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    # ---- bookkeeping the engine calls -----------------------------------------------------------
    def after_prefill(self, reqs, lengths: list[int], hidden_ND: torch.Tensor) -> None:
        """Every prefilled position's next token is now known (the sampled one for the last)."""
        for r, h in zip(reqs, torch.split(hidden_ND, lengths)):
            r.spec_hidden, r.spec_start = h, 0

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def stats(self) -> dict:
        s = self.engine.stats
        rounds = max(s["spec_rounds"], 1)
        return {"speculative_num_steps": self.k,
                "spec_accept_rate": s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1),
                "avg_spec_accept_length": (s["spec_accepted_tokens"] + s["spec_rounds"]) / rounds}

    # ---- one round ---------------------------------------------------------------------------------
    def decode(self) -> None:
        e = self.engine
        reqs = list(e.running)
        b = len(reqs)
        # Every verified position must fit the KV cache: at most context_length - num_tokens drafts.
        k = max(0, min([self.k] + [e.context_length - r.num_tokens for r in reqs]))
        drafts_Bk = self.draft(reqs, k)
        seqs = [[r.output_ids[-1]] + drafts_Bk[i].tolist() for i, r in enumerate(reqs)]
        ctx = CacheAttention(e.cache, list(range(b)), [r.num_tokens - 1 for r in reqs], [k + 1] * b, e.device)
        record = any(r.return_routed_experts for r in reqs)
        logits, routing, hidden_ND = e._forward([t for s in seqs for t in s], ctx, record,
                                                torch.arange(b * (k + 1), device=e.device))
        rows = sampling_rows(reqs, e.device, per_request=k + 1, pinned=e.overlap)
        tokens_N = sample(logits, **rows, fused=e.fused_sampling)
        logps_N = token_logprobs(logits, tokens_N, rows["temperature_B"])
        target_BK = tokens_N.view(b, k + 1)
        accepted_B = accepted_prefix(drafts_Bk, target_BK).tolist()
        tokens, logps = target_BK.tolist(), logps_N.view(b, k + 1).tolist()
        hidden_BKD = hidden_ND.view(b, k + 1, -1)
        emitted, finished = [], []
        for i, r in enumerate(reqs):
            n, reason = 0, None
            while n <= accepted_B[i] and reason is None:
                r.output_ids.append(tokens[i][n])
                r.output_logprobs.append(logps[i][n])
                reason = e._finish_reason(r, tokens[i][n])
                n += 1
            emitted.append(n)
            r.spec_hidden, r.spec_start = hidden_BKD[i, :n], r.num_tokens - 1 - n
            r.spec_verify_ct += 1
            r.spec_accepted += accepted_B[i]
            if reason:
                finished.append((i, reason))
        if routing is not None:
            chunks = torch.stack(routing.recorded, dim=1).to("cpu", torch.int16).split(k + 1)
            for r, chunk, n in zip(reqs, chunks, emitted):
                if r.return_routed_experts:
                    r.routed.append(chunk[:n])
        s = e.stats
        s["decode_tokens"] += sum(emitted)
        s["spec_rounds"] += b
        s["spec_draft_tokens"] += b * k
        s["spec_accepted_tokens"] += sum(accepted_B)
        for slot, reason in sorted(finished, reverse=True):
            e._finish_running(slot, reason)

    def draft(self, reqs, k: int) -> torch.Tensor:
        """k guesses per request [B, k] from the MTP head, sampled with the target's noise."""
        e = self.engine
        b, dev = len(reqs), e.device
        # Catch the head up: rows spec_start.. read the target's hidden states and the known next tokens.
        counts = [r.spec_hidden.shape[0] for r in reqs]
        nxt = []
        for r, c in zip(reqs, counts):
            seq = r.input_ids + r.output_ids
            nxt.extend(seq[r.spec_start + 1: r.spec_start + 1 + c])
        ctx = CacheAttention(self.cache, list(range(b)), [r.spec_start for r in reqs], counts, dev)
        last = torch.cumsum(torch.tensor(counts, device=dev), 0) - 1
        logits, h_ND = e.model.draft(torch.cat([r.spec_hidden for r in reqs]), torch.tensor(nxt, device=dev),
                                     ctx.positions, ctx, at_M=last)
        h_BD = h_ND[last]
        rows = sampling_rows(reqs, dev, pinned=e.overlap)
        row_pos = [r.num_tokens - 1 for r in reqs]  # the head's next row: position of the last token
        drafts = []
        for j in range(k):
            d_B = sample(logits, **{**rows, "positions_B": rows["positions_B"] + j}, fused=e.fused_sampling)
            drafts.append(d_B)
            if j + 1 == k:
                break
            ctx = CacheAttention(self.cache, list(range(b)), [p + j for p in row_pos], [1] * b, dev)
            logits, h_BD = e.model.draft(h_BD, d_B, ctx.positions, ctx)
        if not drafts:
            return torch.zeros(b, 0, dtype=torch.long, device=dev)
        return torch.stack(drafts, 1)
