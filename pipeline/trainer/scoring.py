"""The forward-only pass before a rollout step's first update: old logprobs, reference logprobs and
the critic's values of every response token (targets.Scores), when the step needs them up front."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.buffer.schema import RolloutBatch
from pipeline.config.schema import AlgoConfig, TrainConfig
from pipeline.trainer.base import TrainerBackend
from pipeline.trainer.batching import build_micro_batch
from pipeline.trainer.metrics import StepMetrics
from pipeline.trainer.plan import Plan
from pipeline.trainer.targets import Scores


def needs_score_pass(algo: AlgoConfig, num_minibatches: int) -> bool:
    """Scores before any update are needed for several updates per rollout (PPO's old logprobs),
    for per-token KL rewards, and for a critic's values. Otherwise each micro-batch's own forward is
    its pre-update one. The supervised loss needs none of them."""
    if algo.loss_type == "sft_loss":
        return False
    return num_minibatches > 1 or algo.advantage_estimator == "ppo" or (algo.token_level and algo.kl_coef > 0)


def forward_budget(t: TrainConfig) -> int:
    """Tokens of a forward-only micro-batch: it keeps no activations for backward, so it packs bigger
    than a training one (train.max_tokens_per_gpu_forward, default twice max_tokens_per_gpu)."""
    return t.max_tokens_per_gpu_forward or 2 * t.max_tokens_per_gpu


@torch.no_grad()
def score_pass(backend: TrainerBackend, batch: RolloutBatch, plans: list[Plan], device, replay: bool,
               metrics: StepMetrics) -> Scores:
    """Scores of the samples in `plans` (this rank's: plan them like training, at forward_budget),
    laid out like batch.logprobs (zeros elsewhere). The routing mismatch against the engine is
    measured here, before the policy moves."""
    b = backend
    old = np.zeros_like(batch.logprobs)
    ref = np.zeros_like(batch.logprobs) if b.ref_model is not None else None
    values = np.zeros_like(batch.logprobs) if b.critic is not None else None
    zeros = np.zeros(len(batch.logprobs), dtype=np.float32)
    for plan in plans:
        for idx, weight in plan:
            mb = build_micro_batch(batch, idx, zeros, device, weight=weight, with_routing=b.args.is_moe)
            logp, _, routing = b.logprobs(mb, replay=replay)
            metrics.add_routing(routing, weight)
            if not weight:
                continue
            where = np.concatenate([np.arange(batch.response_offsets[i], batch.response_offsets[i + 1]) for i in idx])
            old[where] = logp.float().cpu().numpy()
            if ref is not None:
                ref[where] = b.ref_logprobs(mb, replay=replay).float().cpu().numpy()
            if values is not None:
                values[where] = b.values(mb).float().cpu().numpy()
    return Scores(old, ref, values)
