"""Per-token log-probabilities, shared by the engine (at sampling time) and the trainer.

Both sides call the same function on the same dtype path, so in true on-policy mode (batch-invariant
kernels) their results agree bit for bit. Temperature is applied before the softmax, matching the
distribution the engine samples from (top-p/top-k truncation is not renormalised, as in SGLang).

Legend: M scored positions, V vocab.
"""

from __future__ import annotations

import torch

import lockstep_kernels as kernels
from lockstep_kernels import GREEDY_EPS, scaled_logits  # noqa: F401  (the kernel library's; re-exported)


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), in fp32. Returns [M]."""
    return kernels.token_logprobs(logits_MV, tokens_M, temperature)


ENTROPY_CHUNK_ROWS = 1024
"""Rows whose fp32 temporaries (scaled logits, log-softmax, its exp, their product) exist at once: 2.5
GB at vocabulary 151936, where a whole 16384-token micro-batch took 40 GB."""


def entropy(logits_MV: torch.Tensor, temperature: float, chunk_rows: int = ENTROPY_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row [M], fp32. Computed chunk by chunk of rows; under
    autograd each chunk is recomputed in backward instead of kept (row-wise math: the same values)."""
    if logits_MV.shape[0] <= chunk_rows:
        return _entropy(logits_MV, temperature)
    from torch.utils.checkpoint import checkpoint

    chunks = logits_MV.split(chunk_rows)
    temps = temperature.split(chunk_rows) if isinstance(temperature, torch.Tensor) else [temperature] * len(chunks)
    if not torch.is_grad_enabled() or not logits_MV.requires_grad:
        return torch.cat([_entropy(c, t) for c, t in zip(chunks, temps)])
    return torch.cat([checkpoint(_entropy, c, t, use_reentrant=False) for c, t in zip(chunks, temps)])


def _entropy(logits_MV: torch.Tensor, temperature) -> torch.Tensor:
    logp = kernels.log_softmax(scaled_logits(logits_MV, temperature))
    return -(logp.exp() * logp).sum(-1)
