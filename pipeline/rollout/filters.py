"""Dynamic-sampling filters: decide, per finished group, whether it is worth training on.

A filter takes the group's list of Samples (rewards scored) and returns True to keep it. Registry
names or a `module:function` path (Miles: --dynamic-sampling-filter-path).
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Callable

from pipeline.errors import UserError


def nonzero_std(samples) -> bool:
    """Drop groups whose rewards are all equal: their GRPO advantages are all zero (no signal)."""
    rewards = [s.reward for s in samples]
    return max(rewards) > min(rewards)


def zero_std_metrics(groups: list[list]) -> dict:
    """How many of the trained groups carry no GRPO signal (all rewards equal, every advantage 0): their
    share, and Miles' per-reward counts (`rollout/zero_std/count_1.0`: all right; `count_0.0`: all
    wrong). A share that stays near 1 means the recipe learns nothing, however long it runs."""
    flat = [g for g in groups if not nonzero_std(g)]
    out = {"rollout/zero_std_frac": len(flat) / len(groups) if groups else 0.0}
    for reward, count in sorted(Counter(float(g[0].reward) for g in flat).items()):
        out[f"rollout/zero_std/count_{reward}"] = count
    return out


def keep_all(samples) -> bool:
    return True


REGISTRY: dict[str, Callable] = {"nonzero_std": nonzero_std, "none": keep_all}


def resolve_filter(name: str | None) -> Callable:
    if name is None or name in REGISTRY:
        return REGISTRY[name or "none"]
    module, sep, attr = name.partition(":")
    if not sep:
        raise UserError(f"rollout.dynamic_sampling_filter {name!r}: not one of {sorted(REGISTRY)} and not module:function")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"rollout.dynamic_sampling_filter {name!r}: cannot import ({e})") from None
