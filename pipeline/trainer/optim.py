"""What both training backends (fsdp.py, megatron/backend.py) build alike: AdamW for the policy and
PPO's critic, the learning-rate schedule, the update rule for a non-finite gradient, which extra
models a run needs (reference, critic), and the INT4 QAT scale dtype.

The optimizer is torch's AdamW on each rank's parameters in both (FSDP2's DTensor shards; megatron's
TP/EP shards as plain tensors), fused (one kernel over all parameters) on GPUs.
"""

from __future__ import annotations

import math

import torch

from pipeline.config.schema import RunConfig

CRITIC_WEIGHT_DECAY = 0.01
"""The critic's AdamW weight decay: torch's default, which the critic has always trained with
(train.weight_decay is the policy's)."""


def needs_reference(cfg: RunConfig) -> bool:
    """A frozen copy of the initial policy: for the KL loss (algo.kl_loss_coef) or KL rewards (algo.kl_coef)."""
    return cfg.algo.kl_loss_coef > 0 or cfg.algo.kl_coef > 0


def needs_critic(cfg: RunConfig) -> bool:
    """PPO trains a critic beside the policy."""
    return cfg.algo.advantage_estimator == "ppo"


def int4_scale_dtype(cfg: RunConfig) -> torch.dtype:
    """INT4 scales are stored (and so trained with) in the export dtype: bf16, or fp32 for fp32 runs."""
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def adamw_settings(cfg: RunConfig, device: torch.device, critic: bool = False) -> dict:
    """AdamW's keyword arguments for the policy (or PPO's critic). fused=True on GPUs: one kernel over
    all shards instead of for-each launches per op; CPU runs keep torch's default implementation,
    whose numbers the CPU tests were written against."""
    t = cfg.train
    return dict(lr=cfg.algo.critic_lr if critic else t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                weight_decay=CRITIC_WEIGHT_DECAY if critic else t.weight_decay,
                fused=True if device.type == "cuda" else None)


def adamw(params, cfg: RunConfig, device: torch.device, critic: bool = False) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **adamw_settings(cfg, device, critic))


def lr_factor(step: int, warmup: int, total: int, style: str, floor: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): warm-up, then decay to `floor`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant" or total <= warmup:
        return 1.0
    frac = min(max((step - warmup) / max(total - warmup - 1, 1), 0.0), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if style == "cosine" else 1.0 - frac
    return floor + (1.0 - floor) * shape


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """train.lr_warmup_steps of warm-up, then train.lr_decay_style to train.min_lr over the run's
    optimizer steps (num_rollout x optimizer steps per rollout)."""
    t = cfg.train
    total = cfg.num_rollout * cfg.optimizer_steps_per_rollout
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.lr_warmup_steps, total, t.lr_decay_style, t.min_lr / t.lr))


def step_if_finite(norm: float, optimizer: torch.optim.Optimizer, scheduler=None) -> bool:
    """Step `optimizer` (and `scheduler`) if the gradient norm is finite, else leave the weights as
    they were; zero the gradients either way. Returns whether it stepped."""
    stepped = math.isfinite(norm)
    if stepped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def policy_and_critic_step(backend, clipped_norm) -> tuple[float, bool]:
    """One update of the policy (and, under PPO, the critic on its own clip norm, only when the policy
    stepped): `clipped_norm(model)` reduces and clips a model's gradients and returns the norm before.
    Returns (policy grad norm, stepped); a non-finite norm skips the update (step_if_finite)."""
    norm = clipped_norm(backend.model)
    stepped = step_if_finite(norm, backend.optimizer, backend.scheduler)
    if backend.critic is not None:
        cnorm = clipped_norm(backend.critic) if stepped else math.nan
        step_if_finite(cnorm, backend.critic_optimizer)
    return norm, stepped
