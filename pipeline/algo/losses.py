"""Policy-gradient losses as pure functions returning (loss, metrics).

Legend: M scored response tokens of a micro-batch; every per-token input is [M]. `mask_M` is 1.0 for
tokens that count. `scale_M` carries the reduction: the loss is sum_t loss_t * scale_t, with scale
built by `reduction_scale` from counts over the whole global batch (all ranks, all micro-batches),
so micro-batches and ranks add up to exactly one token-mean, sample-mean or Dr. GRPO sum.
Metrics are sums (keys ending in `_sum`); the caller reduces them and divides by the token count.
The policy loss takes its settings (PolicyLossConfig, built once from the algo config) and one
micro-batch's tensors (PolicyTokens) as two arguments. `sft_loss` is the supervised loss (Miles
sft_loss): the same reduction over the response tokens, no ratio, no advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio that is exponentiated is clamped to [-20, 20] first (verl's and Miles' bound): a token
whose probability moved by e^100 would make exp() overflow to inf and its gradient NaN. Clamped tokens
get no gradient through the ratio; exp(20) = 4.9e8 is still far outside any clip range."""
LOW_VAR_KL_CLAMP = 10.0
"""low_var_kl's per-token value is clamped to [-10, 10] (the peers' bound)."""


def clamped_log_ratio(logp_M: torch.Tensor, base_logp_M: torch.Tensor) -> torch.Tensor:
    return (logp_M - base_logp_M).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_estimate(logp_M: torch.Tensor, ref_logp_M: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators of Schulman's note: k1, k2, k3 (= low_var_kl, clamped to +-10).
    k3's log-ratio is clamped to +-20 before exp, so it stays finite."""
    log_ratio = logp_M - ref_logp_M
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind in ("k3", "low_var_kl"):
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(-log_ratio) - 1 + log_ratio
        return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown kl type {kind!r}")


def reduction_scale(mask_M, sample_of_M, len_of_sample, kind: str, global_tokens: float, global_samples: float,
                    max_len: int) -> torch.Tensor:
    """Per-token weights for the reduction `kind` (token_mean | sample_mean | seq_mean_token_sum)."""
    if kind == "token_mean":
        return mask_M / max(global_tokens, 1.0)
    if kind == "sample_mean":
        return mask_M / len_of_sample[sample_of_M].clamp(min=1) / max(global_samples, 1.0)
    if kind == "seq_mean_token_sum":  # Dr. GRPO: a constant normaliser, no length bias
        return mask_M / (max(global_samples, 1.0) * max(max_len, 1))
    raise ValueError(f"unknown loss reduction {kind!r}")


def sequence_ratio(log_ratio_M: torch.Tensor, mask_M: torch.Tensor, sample_of_M: torch.Tensor, num_samples: int):
    """GSPO's per-sample ratio exp(mean_t log r_t), broadcast to tokens with the token's own gradient
    path: s_t = sg(s_i) * exp(log r_t - sg(log r_t)) (value s_i, gradient s_i * d log r_t / |y_i|)."""
    sums = torch.zeros(num_samples, dtype=log_ratio_M.dtype, device=log_ratio_M.device)
    sums = sums.index_add(0, sample_of_M, log_ratio_M * mask_M)
    counts = torch.zeros_like(sums).index_add(0, sample_of_M, mask_M).clamp(min=1)
    seq_log_ratio = (sums / counts)[sample_of_M].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(seq_log_ratio.detach() + log_ratio_M - log_ratio_M.detach()), seq_log_ratio


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss's settings: clipping, KL to the reference policy, entropy bonus. Built once
    per run from the algo section (`from_algo`); the per-micro-batch tensors come in PolicyTokens."""

    eps_clip: float = 0.2
    """Clip range below 1 (ratio >= 1 - eps_clip)."""
    eps_clip_high: float | None = None
    """Clip range above 1; None: eps_clip."""
    eps_clip_c: float | None = None
    """Dual clipping: for negative advantages the token loss is at most -A * eps_clip_c; None: off."""
    ratio_type: Literal["token", "sequence"] = "token"
    """token: PPO's per-token ratio; sequence: GSPO's per-sample ratio (needs sample_of_M)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term (needs ref_logp_M when > 0)."""
    kl_type: str = "low_var_kl"
    """KL estimator (kl_estimate's kinds)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs entropy_M when > 0)."""

    @classmethod
    def from_algo(cls, algo) -> PolicyLossConfig:
        """From a pipeline.config.schema.AlgoConfig: GSPO takes the sequence-level ratio."""
        return cls(eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c,
                   ratio_type="sequence" if algo.advantage_estimator == "gspo" else "token",
                   kl_coef=algo.kl_loss_coef, kl_type=algo.kl_loss_type, entropy_coef=algo.entropy_coef)


@dataclass
class PolicyTokens:
    """One micro-batch's per-token inputs of the policy loss, each [M]."""

    logp_M: torch.Tensor
    """Log-probabilities of the policy being trained (with gradient)."""
    old_logp_M: torch.Tensor
    """The ratio's denominator: pre-update (or behaviour) log-probabilities."""
    adv_M: torch.Tensor
    mask_M: torch.Tensor
    """1.0 for tokens that count."""
    scale_M: torch.Tensor
    """Per-token weights of the reduction (reduction_scale; 0 where mask_M is)."""
    ref_logp_M: torch.Tensor | None = None
    """Reference policy's log-probabilities (KL term)."""
    entropy_M: torch.Tensor | None = None
    """Per-token entropy (entropy bonus)."""
    is_weight_M: torch.Tensor | None = None
    """Off-policy correction weights (TIS), multiplied into the token loss, detached."""
    sample_of_M: torch.Tensor | None = None
    """Micro-batch sample index of each token (GSPO's sequence ratio)."""
    num_samples: int = 0
    """Samples in the micro-batch (GSPO's sequence ratio)."""


def policy_loss(cfg: PolicyLossConfig, t: PolicyTokens) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping [1 - eps_clip, 1 + eps_clip_high], optional dual
    clipping (negative advantages: loss at most -A * eps_clip_c) and GSPO's sequence-level ratio.
    is_weight_M: off-policy correction weights (TIS), detached, multiplied into the token loss."""
    eps_clip, eps_clip_c, adv_M, mask_M = cfg.eps_clip, cfg.eps_clip_c, t.adv_M, t.mask_M
    high = eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    log_ratio = t.logp_M - t.old_logp_M
    if cfg.ratio_type == "sequence":
        ratio, _ = sequence_ratio(log_ratio, mask_M, t.sample_of_M, t.num_samples)
    else:
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
    pg1 = -adv_M * ratio
    pg2 = -adv_M * ratio.clamp(1 - eps_clip, 1 + high)
    pg_M = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    if eps_clip_c is not None:
        pg3 = -adv_M * eps_clip_c
        dual = (adv_M < 0) & (pg_M > pg3)
        pg_M = torch.where(adv_M < 0, torch.minimum(pg_M, pg3), pg_M)
    if t.is_weight_M is not None:
        pg_M = pg_M * t.is_weight_M.detach()
    loss = (pg_M * t.scale_M).sum()
    with torch.no_grad():
        metrics = {
            "pg_loss_sum": (pg_M * mask_M).sum(),
            "clipfrac_sum": (clipped * mask_M).sum(),
            "approx_kl_sum": (0.5 * log_ratio**2 * mask_M).sum(),
            "ratio_sum": (ratio * mask_M).sum(),
        }
        if eps_clip_c is not None:
            metrics["dual_clipfrac_sum"] = (dual.float() * mask_M).sum()
    return loss, metrics


def off_policy_weights(old_logp_M, rollout_logp_M, mask_M, *, kind: str, cap: float = 2.0, low: float = 0.5,
                       high: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Correction for the engine/trainer mismatch (rollout logprobs vs the trainer's old logprobs).

    tis: w_t = min(pi_train / pi_rollout, cap) (truncated importance sampling).
    icepop: tokens whose ratio leaves [low, high] are masked out of the loss (w = 1 elsewhere).
    Returns (weights, mask, metrics incl. the effective sample size ESS = (sum w)^2 / (n sum w^2))."""
    ratio = torch.exp(clamped_log_ratio(old_logp_M, rollout_logp_M)).detach()
    if kind == "tis":
        w, mask = ratio.clamp(max=cap), mask_M
    elif kind == "icepop":
        keep = ((ratio >= low) & (ratio <= high)).float()
        w, mask = torch.ones_like(ratio), mask_M * keep
    else:
        raise ValueError(f"unknown off-policy correction {kind!r}")
    wm = w * mask
    metrics = {"is_weight_sum": wm.sum(), "is_weight_sq_sum": (wm**2).sum(),
               "is_masked_sum": (mask_M - mask).sum(), "is_truncated_sum": ((ratio > cap).float() * mask_M).sum()
               if kind == "tis" else torch.zeros((), device=ratio.device)}
    return w, mask, metrics


def value_loss(values_M, old_values_M, returns_M, scale_M, eps_clip_value: float) -> tuple[torch.Tensor, dict]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped = old_values_M + (values_M - old_values_M).clamp(-eps_clip_value, eps_clip_value)
    v_M = 0.5 * torch.maximum((values_M - returns_M) ** 2, (clipped - returns_M) ** 2)
    return (v_M * scale_M).sum(), {"value_loss_sum": (v_M * (scale_M > 0)).sum().detach()}


def grpo_loss(cfg: PolicyLossConfig, t: PolicyTokens) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss + optional KL to a reference policy + optional entropy bonus, one reduction for all."""
    loss, metrics = policy_loss(cfg, t)
    if cfg.kl_coef > 0:
        assert t.ref_logp_M is not None, "kl_coef > 0 needs reference logprobs"
        kl_M = kl_estimate(t.logp_M, t.ref_logp_M, cfg.kl_type)
        loss = loss + cfg.kl_coef * (kl_M * t.scale_M).sum()
        metrics["kl_loss_sum"] = (kl_M * t.mask_M).sum().detach()
    if cfg.entropy_coef > 0:
        assert t.entropy_M is not None, "entropy_coef > 0 needs per-token entropy"
        loss = loss - cfg.entropy_coef * (t.entropy_M * t.scale_M).sum()
        metrics["entropy_sum"] = (t.entropy_M * t.mask_M).sum().detach()
    return loss, metrics


def sft_loss(logp_M: torch.Tensor, mask_M: torch.Tensor, scale_M: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised negative log-likelihood: loss = sum_t -logp_t * scale_t over tokens with mask_t > 0.

    A masked token (a prompt or user turn) adds nothing to the loss and gets a gradient of exactly 0:
    torch.where selects, so not even a non-finite logprob there leaks into the gradient. Metric:
    sft_nll_sum, the NLL summed over the counted tokens (the caller divides by their number)."""
    nll_M = -torch.where(mask_M > 0, logp_M, torch.zeros_like(logp_M))
    loss = (nll_M * scale_M).sum()
    return loss, {"sft_nll_sum": (nll_M * mask_M).sum().detach()}
