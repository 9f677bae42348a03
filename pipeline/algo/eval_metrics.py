"""Evaluation metrics as pure functions: pass@k and the per-set summary of scored samples.

pass@k is Chen et al. 2021's unbiased estimator (the Codex paper, eq. 1): with n samples of a problem
of which c are correct, the chance that k drawn without replacement contain a correct one is
1 - C(n-c, k) / C(n, k); averaged over problems. Taking the fraction of problems with a correct one
among the first k samples instead would be unbiased too but noisier (it uses k of the n samples);
1 - (1 - c/n)^k is biased low. The product form below avoids the huge binomials of large n.

A sample counts as correct when its reward is >= 1 (the 0/1 verifiers' "right": arith, exact_match,
math; a graded reward passes only at full marks), as Miles/slime's pass rate counts reward == 1.
"""

from __future__ import annotations

from dataclasses import dataclass

CORRECT_REWARD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for one problem: n samples, c of them correct, 1 <= k <= n."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    fail = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n (Miles' powers of two)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


@dataclass
class ScoredSample:
    """What the metrics need of one eval response."""

    prompt: int  # index of its prompt in the set
    reward: float
    response_len: int
    truncated: bool  # stopped by the length limit, not by end-of-sequence
    weight_version: int


def eval_summary(samples: list[ScoredSample], n_per_prompt: int) -> dict[str, float]:
    """reward_mean, pass@k for k in pass_ks(n), response_len_mean, truncated_frac, weight_version (the
    oldest that answered; in async modes an update can land mid-evaluation: weight_version_max)."""
    assert samples, "an eval set has at least one prompt"
    by_prompt: dict[int, list[ScoredSample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt, []).append(s)
    assert all(len(v) == n_per_prompt for v in by_prompt.values()), "every prompt has n samples"
    n = len(samples)
    out = {"reward_mean": sum(s.reward for s in samples) / n}
    for k in pass_ks(n_per_prompt):
        out[f"pass@{k}"] = sum(pass_at_k(n_per_prompt, sum(s.reward >= CORRECT_REWARD for s in group), k)
                               for group in by_prompt.values()) / len(by_prompt)
    out.update({
        "response_len_mean": sum(s.response_len for s in samples) / n,
        "truncated_frac": sum(s.truncated for s in samples) / n,
        "num_prompts": len(by_prompt),
        "num_samples": n,
        "weight_version": min(s.weight_version for s in samples),
        "weight_version_max": max(s.weight_version for s in samples),
    })
    return out
