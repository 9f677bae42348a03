"""What the loss is computed against: pre-update scores and per-token advantages of a rollout batch.

Arrays here use the batch's response-token layout (R = all response tokens, sample after sample,
like RolloutBatch.logprobs): `batch.response_slice(i)` indexes sample i in every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.algo import advantages as A
from pipeline.buffer.schema import RolloutBatch
from pipeline.config.schema import AlgoConfig


@dataclass
class Scores:
    """Per-token results of the forward-only pass before any update of this rollout step."""

    old_logp_R: np.ndarray
    ref_logp_R: np.ndarray | None = None
    values_R: np.ndarray | None = None


@dataclass
class Targets:
    """One micro-batch's share of the scores and returns, [M] on the device (None: not computed; the
    loss then takes the policy's own pre-update forward as the old logprobs)."""

    old_logp_M: torch.Tensor | None = None
    ref_logp_M: torch.Tensor | None = None
    old_values_M: torch.Tensor | None = None
    returns_M: torch.Tensor | None = None


def take(arr_R: np.ndarray | None, batch: RolloutBatch, idx: list[int]) -> np.ndarray | None:
    """The tokens of samples `idx` (in order) from an R-layout array."""
    if arr_R is None:
        return None
    return np.concatenate([arr_R[batch.response_slice(i)] for i in idx])


def micro_batch_targets(batch: RolloutBatch, idx: list[int], scores: Scores | None, returns_R: np.ndarray | None,
                        device) -> Targets:
    """The Targets of the micro-batch of samples `idx`."""

    def tensor(arr_R):
        arr = take(arr_R, batch, idx)
        return None if arr is None else torch.from_numpy(np.ascontiguousarray(arr)).to(device)

    if scores is None:
        return Targets(returns_M=tensor(returns_R))
    return Targets(tensor(scores.old_logp_R), tensor(scores.ref_logp_R), tensor(scores.values_R), tensor(returns_R))


def sample_advantages(batch: RolloutBatch, cfg: AlgoConfig) -> np.ndarray:
    """grpo / gspo / dr_grpo: one advantage per sample from all samples' rewards (every rank has them)."""
    std = cfg.grpo_std_normalization and cfg.advantage_estimator != "dr_grpo"
    return A.grpo_advantages(torch.from_numpy(batch.rewards), torch.from_numpy(batch.group_id),
                             std_normalization=std).numpy()


def token_advantages(batch: RolloutBatch, local: list[int], scores: Scores | None, cfg: AlgoConfig,
                     global_moments) -> tuple[np.ndarray, np.ndarray | None]:
    """R-layout advantages (and PPO returns) for this rank's samples `local`.

    Sample-level estimators broadcast each sample's advantage to its tokens. Token-level estimators
    compute returns (or GAE) per sample, then whiten with the global mean and variance, which
    `global_moments(sum, sum_sq, count) -> (sum, sum_sq, count)` reduces across ranks. The supervised
    loss has no rewards: zeros.
    """
    if cfg.loss_type == "sft_loss":
        return np.zeros(len(batch.logprobs), dtype=np.float32), None
    if not cfg.token_level:
        return np.repeat(sample_advantages(batch, cfg), batch.response_len).astype(np.float32), None
    rewards = batch.rewards.astype(np.float64)
    if cfg.advantage_estimator == "reinforce_plus_plus_baseline":
        mean, _ = A.group_stats(torch.from_numpy(rewards), torch.from_numpy(batch.group_id))
        rewards = rewards - mean.numpy()
    raw = np.zeros(len(batch.logprobs), dtype=np.float64)
    returns = np.zeros_like(raw) if cfg.advantage_estimator == "ppo" else None
    for i in local:
        sl = batch.response_slice(i)
        n = sl.stop - sl.start
        kl = None
        if cfg.kl_coef and scores is not None and scores.ref_logp_R is not None:
            kl = A.kl_estimate_np(scores.old_logp_R[sl], scores.ref_logp_R[sl])
        if cfg.advantage_estimator == "reinforce_plus_plus_baseline":
            # Miles/slime/verl: the sample's (reward - group mean) on every token, minus that token's own
            # KL penalty; no discounting, no sum of later tokens' KL (gamma does not apply).
            raw[sl] = rewards[i] - (cfg.kl_coef * kl if kl is not None else 0.0)
            continue
        r = np.zeros(n)
        if kl is not None:
            r -= cfg.kl_coef * kl
        r[-1] += rewards[i]
        if cfg.advantage_estimator == "ppo":
            v = scores.values_R[sl].astype(np.float64)
            adv, ret = A.gae_np(r, v, cfg.gamma, cfg.lambd)
            raw[sl], returns[sl] = adv, ret
        else:
            raw[sl] = A.returns_np(r, cfg.gamma)
    mask = np.zeros_like(raw)
    for i in local:
        mask[batch.response_slice(i)] = batch.loss_mask[batch.response_slice(i)]
    total, total_sq, count = global_moments(float((raw * mask).sum()), float((raw**2 * mask).sum()), float(mask.sum()))
    mean = total / max(count, 1.0)
    var = max(total_sq / max(count, 1.0) - mean**2, 0.0) * count / max(count - 1, 1.0)
    adv = (raw - mean) / np.sqrt(var + 1e-8)
    return adv.astype(np.float32), (returns.astype(np.float32) if returns is not None else None)
