"""Advantages and losses against hand computations."""

from __future__ import annotations

import math

import torch

from pipeline.algo.advantages import grpo_advantages, group_stats
from pipeline.algo.losses import grpo_loss, kl_estimate, ppo_clip_loss


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group 7: mean 0.25, unbiased std sqrt((0.5625 + 3*0.0625)/3) = 0.5
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # group 3: mean 0.5, std sqrt((0 + 0 + 0.25 + 0.25)/3)
    s = math.sqrt(0.5 / 3)
    assert torch.allclose(adv[4:], torch.tensor([0.0, 0.0, 0.5 / s, -0.5 / s]))
    dr = grpo_advantages(rewards, groups, std_normalization=False)
    assert torch.allclose(dr, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.5, -0.5]))
    # A group with equal rewards has zero advantage (no signal), not NaN.
    flat = grpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long))
    assert torch.equal(flat, torch.zeros(4))


def test_group_stats_interleaved_ids():
    mean, std = group_stats(torch.tensor([1.0, 10.0, 3.0, 20.0]), torch.tensor([0, 1, 0, 1]))
    assert mean.tolist() == [2.0, 15.0, 2.0, 15.0]
    assert torch.allclose(std, torch.tensor([math.sqrt(2), math.sqrt(50), math.sqrt(2), math.sqrt(50)]))


def test_ppo_clip_by_hand():
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), 0.0])
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -2.0, 3.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, m = ppo_clip_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, normalizer=3.0)
    # token 0: ratio 1.5, A=1 -> max(-1.5, -1.28) = -1.28 (clipped)
    # token 1: ratio 0.5, A=1 -> max(-0.5, -0.8) = -0.5 (not clipped: the pessimistic term wins)
    # token 2: ratio 1.1, A=-2 -> max(2.2, 2.2) = 2.2
    expected = (-1.28 - 0.5 + 2.2) / 3
    assert abs(float(loss) - expected) < 1e-6
    assert float(m["clipfrac_sum"]) == 1.0


def test_ppo_gradient_zero_when_clipped():
    logp = torch.tensor([math.log(1.5)], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1), torch.ones(1), torch.ones(1), 0.2, 0.2, 1.0)
    loss.backward()
    assert float(logp.grad) == 0.0
    logp2 = torch.tensor([0.0], requires_grad=True)  # ratio 1: gradient -A * ratio
    loss2, _ = ppo_clip_loss(logp2, torch.zeros(1), torch.tensor([2.0]), torch.ones(1), 0.2, 0.2, 1.0)
    loss2.backward()
    assert float(logp2.grad) == -2.0


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    r = math.log(2)  # log(p/ref)
    assert abs(float(kl_estimate(logp, ref, "k1")) - r) < 1e-6
    assert abs(float(kl_estimate(logp, ref, "k2")) - 0.5 * r * r) < 1e-6
    assert abs(float(kl_estimate(logp, ref, "low_var_kl")) - (0.5 - 1 + r)) < 1e-6


def test_grpo_loss_adds_kl_and_entropy():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    ent = torch.tensor([0.3, 0.7])
    base, _ = grpo_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2), eps_clip=0.2, eps_clip_high=None,
                        normalizer=2.0)
    full, m = grpo_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2), eps_clip=0.2, eps_clip_high=None,
                        normalizer=2.0, ref_logp_M=ref, kl_coef=0.1, entropy_M=ent, entropy_coef=0.01)
    kl = float(kl_estimate(logp, ref, "low_var_kl").sum())
    assert abs(float(full) - (float(base) + 0.1 * kl / 2 - 0.01 * 1.0 / 2)) < 1e-6
    assert abs(float(m["kl_loss_sum"]) - kl) < 1e-6


def test_lr_schedule():
    from pipeline.trainer.fsdp import lr_factor

    assert lr_factor(0, 4, 100, "constant", 0.0) == 0.25 and lr_factor(3, 4, 100, "constant", 0.0) == 1.0
    assert lr_factor(0, 0, 11, "cosine", 0.1) == 1.0 and abs(lr_factor(10, 0, 11, "cosine", 0.1) - 0.1) < 1e-12
    assert abs(lr_factor(5, 0, 11, "linear", 0.0) - 0.5) < 1e-12
