"""Advantage estimators: rewards (and, for PPO, values) -> per-token advantages.

Legend: S samples, M response tokens of a batch laid out sample after sample, `sample_of_M` the
sample index of each token. Pure functions over tensors; no config objects, no I/O.

  grpo                          (r - mean_group) / (std_group + eps), the same for every token
  dr_grpo                       r - mean_group (no std normalisation; Dr. GRPO)
  gspo                          as grpo (GSPO changes the ratio, not the advantage: losses.py)
  reinforce_plus_plus           per-token rewards (final reward minus KL penalty), discounted returns,
                                whitened over the whole batch (pipeline/trainer/targets.py)
  reinforce_plus_plus_baseline  (r - mean_group) on every token minus the token's KL penalty, whitened
                                over the batch; undiscounted, as in Miles/slime/verl (gamma must be 1)
  ppo                           GAE(gamma, lambda) over per-token rewards with a critic's values
The token-level ones are per-sample NumPy functions below; targets.py applies them and whitens.
"""

from __future__ import annotations

import numpy as np
import torch


def group_stats(rewards_S: torch.Tensor, group_ids_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and (unbiased, like torch.std) std of its group's rewards."""
    _, inverse = torch.unique(group_ids_S, return_inverse=True)
    g = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(g, dtype=rewards_S.dtype).index_add_(0, inverse, torch.ones_like(rewards_S))
    total = torch.zeros(g, dtype=rewards_S.dtype).index_add_(0, inverse, rewards_S)
    mean_G = total / count
    sq = torch.zeros(g, dtype=rewards_S.dtype).index_add_(0, inverse, (rewards_S - mean_G[inverse]) ** 2)
    std_G = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean_G[inverse], std_G[inverse]


def grpo_advantages(rewards_S: torch.Tensor, group_ids_S: torch.Tensor, std_normalization: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps); without std normalisation it is Dr. GRPO's r - mean."""
    mean, std = group_stats(rewards_S.double(), group_ids_S)
    adv = rewards_S.double() - mean
    if std_normalization:
        adv = adv / (std + eps)
    return adv.to(rewards_S.dtype)


def returns_np(r: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted returns of one sample's per-token rewards: G_t = r_t + gamma G_{t+1}."""
    out = np.empty_like(r, dtype=np.float64)
    running = 0.0
    for t in range(len(r) - 1, -1, -1):
        running = r[t] + gamma * running
        out[t] = running
    return out


def gae_np(r: np.ndarray, v: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE of one sample: delta_t = r_t + gamma V_{t+1} - V_t (V past the last token = 0),
    A_t = delta_t + gamma lambda A_{t+1}. Returns (advantages, returns = A + V)."""
    next_v = np.append(v[1:], 0.0)
    delta = r + gamma * next_v - v
    adv = returns_np(delta, gamma * lam)
    return adv, adv + v


def kl_estimate_np(logp: np.ndarray, ref_logp: np.ndarray) -> np.ndarray:
    """Per-token KL penalty for rewards (k1: log pi - log pi_ref)."""
    return logp.astype(np.float64) - ref_logp.astype(np.float64)
