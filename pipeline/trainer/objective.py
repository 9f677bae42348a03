"""The loss of one micro-batch: the policy's forward, then the algorithm's terms (pipeline/algo/losses.py)
put together: off-policy correction, the clipped policy loss with its KL and entropy terms, PPO's
value loss, the MTP draft head's loss; or, with algo.loss_type=sft_loss, the supervised NLL of the
response tokens alone. Legend: M scored response tokens of the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.algo.losses import (PolicyLossConfig, PolicyTokens, grpo_loss, off_policy_weights, reduction_scale, sft_loss,
                                  value_loss)
from pipeline.config.schema import RunConfig
from pipeline.models.config import ModelArgs
from pipeline.trainer.base import TrainerBackend
from pipeline.trainer.batching import MicroBatch
from pipeline.trainer.plan import GlobalCounts
from pipeline.trainer.targets import Targets


@dataclass(frozen=True)
class Objective:
    """What a micro-batch's loss is made of: the run's settings, read once."""

    policy: PolicyLossConfig
    reduction: str
    """algo.loss_reduction."""
    off_policy: str
    """none | tis | icepop (RunConfig.off_policy_correction)."""
    tis_clip: float
    icepop_low: float
    icepop_high: float
    use_rollout_logprobs: bool
    """The ratio's denominator is the engine's logprobs instead of the trainer's pre-update ones."""
    value_loss_coef: float
    eps_clip_value: float
    mtp_coef: float
    """Weight of the MTP head's loss; 0: the policy has no head, or it is not trained."""
    replay: bool
    """R3: the forward replays the engine's experts."""
    loss_type: str = "policy_loss"
    """algo.loss_type: policy_loss (RL) or sft_loss (supervised NLL of the response tokens)."""

    @classmethod
    def from_config(cls, cfg: RunConfig, args: ModelArgs) -> Objective:
        a = cfg.algo
        return cls(policy=PolicyLossConfig.from_algo(a), reduction=a.loss_reduction, off_policy=cfg.off_policy_correction,
                   tis_clip=a.tis_clip, icepop_low=a.icepop_low, icepop_high=a.icepop_high,
                   use_rollout_logprobs=a.use_rollout_logprobs, value_loss_coef=a.value_loss_coef,
                   eps_clip_value=a.eps_clip_value,
                   mtp_coef=cfg.train.mtp_loss_scaling_factor if args.mtp_num_hidden_layers else 0.0,
                   replay=cfg.determinism.routing_replay, loss_type=a.loss_type)


@dataclass
class MicroBatchLoss:
    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    """The loss terms' metric sums (keys ending in _sum)."""
    old_logp_M: torch.Tensor | None
    """The pre-update logprobs the ratio used (or would have: see Objective.use_rollout_logprobs); None
    for the supervised loss, which has no ratio (and no engine logprobs to compare)."""
    routing: object
    """The forward's MoE routing state (None for dense models)."""


def micro_batch_loss(obj: Objective, b: TrainerBackend, mb: MicroBatch, targets: Targets,
                     counts: GlobalCounts) -> MicroBatchLoss:
    """Forward the policy (and the critic, the reference model when needed) on `mb`; its weighted
    share of the mini-batch's loss."""
    if obj.loss_type == "sft_loss":
        return supervised_loss(obj, b, mb, counts)
    p = obj.policy
    logp_M, ent_M, routing, *mtp = b.logprobs(mb, replay=obj.replay, want_entropy=p.entropy_coef > 0,
                                              want_mtp=obj.mtp_coef > 0)
    old_M = targets.old_logp_M
    if old_M is None:  # one update per rollout: this forward is the pre-update one
        old_M = logp_M.detach()
    behaviour_M = mb.rollout_logp_M if obj.use_rollout_logprobs else old_M
    ref_M = targets.ref_logp_M
    if ref_M is None and b.ref_model is not None and p.kl_coef > 0:
        ref_M = b.ref_logprobs(mb, replay=obj.replay)
    mask_M, is_w, is_metrics = mb.mask_M, None, {}
    if obj.off_policy != "none":
        is_w, mask_M, is_metrics = off_policy_weights(old_M, mb.rollout_logp_M, mb.mask_M, kind=obj.off_policy,
                                                      cap=obj.tis_clip, low=obj.icepop_low, high=obj.icepop_high)
    scale_M = reduction_scale(mask_M, mb.sample_of_M, mb.len_of_sample, obj.reduction, counts.tokens,
                              counts.samples, counts.max_len) * mb.weight
    loss, m = grpo_loss(p, PolicyTokens(logp_M, behaviour_M, mb.adv_M, mask_M, scale_M, ref_logp_M=ref_M,
                                        entropy_M=ent_M, is_weight_M=is_w, sample_of_M=mb.sample_of_M,
                                        num_samples=mb.num_samples))
    if b.critic is not None:
        v_loss, vm = value_loss(b.values(mb), targets.old_values_M, targets.returns_M, scale_M, obj.eps_clip_value)
        loss = loss + obj.value_loss_coef * v_loss
        m.update(vm)
    if mtp:
        # The draft head learns the next-next token of the same sequences; its share is scaled like
        # the policy loss (per token of the global batch), and its inputs are detached.
        s = mtp[0]
        nll_sum = -(s.logp_M * s.mask_M).sum()
        loss = loss + obj.mtp_coef * (nll_sum / max(counts.tokens, 1.0)) * mb.weight
        m.update(mtp_nll_sum=nll_sum.detach(), mtp_hit_sum=(s.hit_M * s.mask_M).sum(), mtp_tokens_sum=s.mask_M.sum())
    return MicroBatchLoss(loss, {**m, **is_metrics}, old_M, routing)


def supervised_loss(obj: Objective, b: TrainerBackend, mb: MicroBatch, counts: GlobalCounts) -> MicroBatchLoss:
    """algo.loss_type=sft_loss: the policy's NLL of the target tokens (mask 1), reduced like the policy
    loss (algo.loss_reduction over the global batch)."""
    logp_M, _, routing = b.logprobs(mb, replay=obj.replay)
    scale_M = reduction_scale(mb.mask_M, mb.sample_of_M, mb.len_of_sample, obj.reduction, counts.tokens,
                              counts.samples, counts.max_len) * mb.weight
    loss, m = sft_loss(logp_M, mb.mask_M, scale_M)
    return MicroBatchLoss(loss, m, None, routing)
