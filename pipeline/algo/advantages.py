"""Advantage estimators: rewards of a rollout step -> one advantage per sample (broadcast over its tokens).

Legend: S samples. Pure functions over tensors; no config objects, no I/O.
"""

from __future__ import annotations

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
