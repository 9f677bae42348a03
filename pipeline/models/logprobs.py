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


def entropy(logits_MV: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = kernels.log_softmax(scaled_logits(logits_MV, temperature))
    return -(logp.exp() * logp).sum(-1)
