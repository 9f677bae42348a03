"""Policy-gradient losses as pure functions returning (loss, metrics).

Legend: M scored response tokens of a micro-batch. Every per-token input is [M]; `mask_M` is 1.0 for
tokens that count. Losses are *sums* over tokens divided by `normalizer` (the token count of the whole
global batch across ranks), so micro-batches and ranks add up to one token-mean. Metrics are sums
too (keys ending in `_sum`), reduced and divided by the token count by the caller.
"""

from __future__ import annotations

import torch


def kl_estimate(logp_M: torch.Tensor, ref_logp_M: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators of Schulman's note: k1, k2, k3 (= low_var_kl, clamped)."""
    log_ratio = logp_M - ref_logp_M
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
        return kl.clamp(-10, 10) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown kl type {kind!r}")


def ppo_clip_loss(logp_M, old_logp_M, adv_M, mask_M, eps_clip: float, eps_clip_high: float,
                  normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, asymmetric clip range [1 - eps_clip, 1 + eps_clip_high]."""
    log_ratio = logp_M - old_logp_M
    ratio = torch.exp(log_ratio)
    pg1 = -adv_M * ratio
    pg2 = -adv_M * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg_M = torch.maximum(pg1, pg2)
    loss = (pg_M * mask_M).sum() / normalizer
    with torch.no_grad():
        metrics = {
            "pg_loss_sum": (pg_M * mask_M).sum(),
            "clipfrac_sum": ((pg2 > pg1).float() * mask_M).sum(),
            "approx_kl_sum": (0.5 * log_ratio**2 * mask_M).sum(),
            "ratio_sum": (ratio * mask_M).sum(),
            "ratio_max": (ratio * mask_M).max() if mask_M.numel() else ratio.new_zeros(()),
        }
    return loss, metrics


def grpo_loss(logp_M, old_logp_M, adv_M, mask_M, *, eps_clip: float, eps_clip_high: float | None,
              normalizer: float, ref_logp_M=None, kl_coef: float = 0.0, kl_type: str = "low_var_kl",
              entropy_M=None, entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO/PPO policy loss + optional KL to a reference policy + optional entropy bonus."""
    loss, metrics = ppo_clip_loss(logp_M, old_logp_M, adv_M, mask_M, eps_clip,
                                  eps_clip if eps_clip_high is None else eps_clip_high, normalizer)
    if kl_coef > 0:
        assert ref_logp_M is not None, "kl_coef > 0 needs reference logprobs"
        kl_M = kl_estimate(logp_M, ref_logp_M, kl_type)
        loss = loss + kl_coef * (kl_M * mask_M).sum() / normalizer
        metrics["kl_loss_sum"] = (kl_M * mask_M).sum().detach()
    if entropy_coef > 0:
        assert entropy_M is not None, "entropy_coef > 0 needs per-token entropy"
        loss = loss - entropy_coef * (entropy_M * mask_M).sum() / normalizer
        metrics["entropy_sum"] = (entropy_M * mask_M).sum().detach()
    return loss, metrics
