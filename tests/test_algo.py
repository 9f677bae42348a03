"""Advantages and losses against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

import torch

from pipeline.algo.advantages import grpo_advantages, group_stats
from pipeline.algo.losses import (PolicyLossConfig, PolicyTokens, grpo_loss, kl_estimate, off_policy_weights,
                                  policy_loss, reduction_scale, value_loss)


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
    loss, m = policy_loss(PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28), PolicyTokens(logp, old, adv, mask, mask / 3.0))
    # token 0: ratio 1.5, A=1 -> max(-1.5, -1.28) = -1.28 (clipped)
    # token 1: ratio 0.5, A=1 -> max(-0.5, -0.8) = -0.5 (not clipped: the pessimistic term wins)
    # token 2: ratio 1.1, A=-2 -> max(2.2, 2.2) = 2.2
    expected = (-1.28 - 0.5 + 2.2) / 3
    assert abs(float(loss) - expected) < 1e-6
    assert float(m["clipfrac_sum"]) == 1.0


def test_ppo_gradient_zero_when_clipped():
    logp = torch.tensor([math.log(1.5)], requires_grad=True)
    loss, _ = policy_loss(PolicyLossConfig(eps_clip=0.2),
                          PolicyTokens(logp, torch.zeros(1), torch.ones(1), torch.ones(1), torch.ones(1)))
    loss.backward()
    assert float(logp.grad) == 0.0
    logp2 = torch.tensor([0.0], requires_grad=True)  # ratio 1: gradient -A * ratio
    loss2, _ = policy_loss(PolicyLossConfig(eps_clip=0.2),
                           PolicyTokens(logp2, torch.zeros(1), torch.tensor([2.0]), torch.ones(1), torch.ones(1)))
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
    tokens = PolicyTokens(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2), torch.ones(2) / 2.0,
                          ref_logp_M=ref, entropy_M=ent)
    base, _ = grpo_loss(PolicyLossConfig(eps_clip=0.2), tokens)
    full, m = grpo_loss(PolicyLossConfig(eps_clip=0.2, kl_coef=0.1, entropy_coef=0.01), tokens)
    kl = float(kl_estimate(logp, ref, "low_var_kl").sum())
    assert abs(float(full) - (float(base) + 0.1 * kl / 2 - 0.01 * 1.0 / 2)) < 1e-6
    assert abs(float(m["kl_loss_sum"]) - kl) < 1e-6


def test_policy_loss_config_from_algo():
    from pipeline.config.schema import AlgoConfig

    cfg = PolicyLossConfig.from_algo(AlgoConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4,
                                                kl_loss_coef=0.1, kl_loss_type="k2", entropy_coef=0.01))
    assert cfg == PolicyLossConfig(eps_clip=3e-4, eps_clip_high=4e-4, ratio_type="sequence", kl_coef=0.1, kl_type="k2",
                                   entropy_coef=0.01)
    assert PolicyLossConfig.from_algo(AlgoConfig()).ratio_type == "token"


def test_lr_schedule():
    from pipeline.trainer.optim import lr_factor

    assert lr_factor(0, 4, 100, "constant", 0.0) == 0.25 and lr_factor(3, 4, 100, "constant", 0.0) == 1.0
    assert lr_factor(0, 0, 11, "cosine", 0.1) == 1.0 and abs(lr_factor(10, 0, 11, "cosine", 0.1) - 0.1) < 1e-12
    assert abs(lr_factor(5, 0, 11, "linear", 0.0) - 0.5) < 1e-12


def test_dual_clip_caps_negative_advantage_loss():
    # ratio 5, A = -1: unclipped -A*r = 5, clipped -A*1.2 = 1.2 -> max 5 -> dual clip caps at -A*3 = 3
    logp = torch.tensor([math.log(5.0), math.log(5.0)])
    adv = torch.tensor([-1.0, 1.0])
    loss, m = policy_loss(PolicyLossConfig(eps_clip=0.2, eps_clip_c=3.0),
                          PolicyTokens(logp, torch.zeros(2), adv, torch.ones(2), torch.ones(2)))
    # token 1 (A=+1): max(-5, -1.2) = -1.2, untouched by the dual clip
    assert abs(float(loss) - (3.0 - 1.2)) < 1e-6 and float(m["dual_clipfrac_sum"]) == 1.0


def test_gspo_sequence_ratio_by_hand():
    # sample 0: token log-ratios 0.1, 0.3 -> sequence ratio exp(0.2) for both tokens; sample 1: exp(-0.1)
    log_ratio = torch.tensor([0.1, 0.3, -0.1], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = policy_loss(PolicyLossConfig(eps_clip=0.5, ratio_type="sequence"),
                          PolicyTokens(log_ratio, torch.zeros(3), adv, torch.ones(3), torch.ones(3),
                                       sample_of_M=torch.tensor([0, 0, 1]), num_samples=2))
    expected = -2 * math.exp(0.2) + math.exp(-0.1)
    assert abs(float(loss.detach()) - expected) < 1e-6
    loss.backward()
    # d/dlogp_t of -A * s_i: -A * s_i for each token (the GSPO-token gradient)
    assert torch.allclose(log_ratio.grad, torch.tensor([-math.exp(0.2), -math.exp(0.2), math.exp(-0.1)]), atol=1e-6)


def test_reductions_by_hand():
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    sample_of = torch.tensor([0, 0, 1, 1])
    lens = torch.tensor([2.0, 1.0])
    assert torch.allclose(reduction_scale(mask, sample_of, lens, "token_mean", 6, 4, 8), mask / 6)
    assert torch.allclose(reduction_scale(mask, sample_of, lens, "sample_mean", 6, 4, 8),
                          torch.tensor([1 / 8, 1 / 8, 1 / 4, 0.0]))
    assert torch.allclose(reduction_scale(mask, sample_of, lens, "seq_mean_token_sum", 6, 4, 8), mask / 32)


def test_tis_and_icepop_by_hand():
    old = torch.log(torch.tensor([0.5, 0.9, 0.1]))
    rollout = torch.log(torch.tensor([0.1, 0.9, 0.4]))  # ratios 5, 1, 0.25
    w, mask, m = off_policy_weights(old, rollout, torch.ones(3), kind="tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 1.0, 0.25])) and torch.equal(mask, torch.ones(3))
    assert float(m["is_truncated_sum"]) == 1.0
    w, mask, m = off_policy_weights(old, rollout, torch.ones(3), kind="icepop", low=0.5, high=2.0)
    assert torch.equal(mask, torch.tensor([0.0, 1.0, 0.0])) and float(m["is_masked_sum"]) == 2.0


def test_value_loss_clipped_by_hand():
    v, v_old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.0, 1.0])
    loss, _ = value_loss(v, v_old, ret, torch.ones(2), eps_clip_value=0.2)
    # token 0: max((1-0)^2, (0.7-0)^2) = 1 ; token 1: max(1, 1) = 1 ; times 0.5
    assert abs(float(loss) - 1.0) < 1e-6


def test_returns_and_gae_by_hand():
    from pipeline.algo.advantages import gae_np, returns_np

    assert returns_np(np.array([1.0, 0.0, 2.0]), 0.5).tolist() == [1.5, 1.0, 2.0]
    r, v = np.array([0.0, 1.0]), np.array([0.2, 0.4])
    adv, ret = gae_np(r, v, gamma=0.9, lam=0.8)
    d1 = 1.0 - 0.4  # last token: V_next = 0
    d0 = 0.0 + 0.9 * 0.4 - 0.2
    assert np.allclose(adv, [d0 + 0.9 * 0.8 * d1, d1]) and np.allclose(ret, adv + v)


def test_token_advantages_whitened_across_ranks():
    """REINFORCE++ advantages of two 'ranks' whitened with global moments equal one rank holding all."""
    from pipeline.buffer.schema import RolloutBatch, Sample
    from pipeline.config.schema import AlgoConfig
    from pipeline.trainer.targets import token_advantages

    samples = [Sample(i // 2, i % 2, 0, [1, 2], [3] * (1 + i), [-0.5] * (1 + i), reward=float(i % 3)) for i in range(6)]
    batch = RolloutBatch.from_samples(samples)
    cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus", gamma=0.9)
    single, _ = token_advantages(batch, list(range(6)), None, cfg, lambda *v: v)
    parts = {}

    def fake_allreduce(*v):  # the sum of both ranks' moments, as all_reduce would give
        return tuple(a + b for a, b in zip(parts["a"], parts["b"]))

    from pipeline.trainer import targets

    raw_a = targets.token_advantages(batch, [0, 1, 2], None, cfg, lambda *v: parts.setdefault("a", v))
    raw_b = targets.token_advantages(batch, [3, 4, 5], None, cfg, lambda *v: parts.setdefault("b", v))
    del raw_a, raw_b
    adv_a, _ = token_advantages(batch, [0, 1, 2], None, cfg, fake_allreduce)
    adv_b, _ = token_advantages(batch, [3, 4, 5], None, cfg, fake_allreduce)
    split = np.where(np.arange(len(single)) < batch.response_offsets[3], adv_a, adv_b)
    assert np.allclose(split, single, atol=1e-6)
    assert abs(single.mean()) < 1e-6


def test_reinforce_plus_plus_baseline_is_miles_definition():
    """(reward - group mean) on every token minus the token's own KL penalty, then whitened over the
    batch: by hand for two groups of two, one with a reference policy's per-token KL."""
    from pipeline.buffer.schema import RolloutBatch, Sample
    from pipeline.config.schema import AlgoConfig
    from pipeline.errors import ConfigError
    from pipeline.trainer.targets import Scores, token_advantages

    lens = [2, 3, 1, 2]
    rewards = [1.0, 0.0, 0.5, 0.5]
    samples = [Sample(i // 2, i % 2, 0, [1, 2], [3] * n, [-0.5] * n, reward=r)
               for i, (n, r) in enumerate(zip(lens, rewards))]
    batch = RolloutBatch.from_samples(samples)
    old = np.linspace(-1.0, -0.2, sum(lens)).astype(np.float32)
    ref = (old - 0.1 * np.arange(sum(lens))).astype(np.float32)
    scores = Scores(old, ref, None)
    cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5)
    adv, _ = token_advantages(batch, list(range(4)), scores, cfg, lambda *v: v)
    centred = np.repeat([0.5, -0.5, 0.0, 0.0], lens) - 0.5 * (old.astype(np.float64) - ref)
    want = (centred - centred.mean()) / np.sqrt(centred.var(ddof=1) + 1e-8)
    assert np.allclose(adv, want, atol=1e-6)
    with pytest.raises(ConfigError, match="gamma must be 1"):
        AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", gamma=0.9)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("estimator, dual", [("grpo", None), ("grpo", 3.0), ("gspo", None)])
def test_extreme_log_ratios_give_finite_losses_and_gradients(kl_type, estimator, dual):
    """Log-ratios of +-100 against the old and the reference policy (a token whose probability moved by
    e^100): every loss term and its gradient stay finite (log-ratios clamped to +-20 before exp,
    low_var_kl to +-10, as verl and Miles do)."""
    from pipeline.config.schema import AlgoConfig

    algo = AlgoConfig(advantage_estimator=estimator, eps_clip_c=dual, kl_loss_coef=0.1, kl_loss_type=kl_type)
    logp = torch.tensor([-0.5, -1.0, -0.1, -2.0], requires_grad=True)
    old = logp.detach() + torch.tensor([100.0, -100.0, 100.0, -100.0])
    ref = logp.detach() + torch.tensor([-100.0, 100.0, 0.0, 50.0])
    t = PolicyTokens(logp, old, torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.ones(4), torch.full((4,), 0.25),
                     ref_logp_M=ref, sample_of_M=torch.tensor([0, 0, 1, 1]), num_samples=2)
    loss, metrics = grpo_loss(PolicyLossConfig.from_algo(algo), t)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    if kl_type == "low_var_kl":
        assert float(metrics["kl_loss_sum"].abs().max()) <= 4 * 10.0
    w, _, m = off_policy_weights(old, logp.detach(), torch.ones(4), kind="tis")
    assert torch.isfinite(w).all() and all(torch.isfinite(v).all() for v in m.values())
