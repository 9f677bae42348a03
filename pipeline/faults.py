"""Fault injection for the reliability tests: real processes, made to fail at chosen points.

LOCKSTEP_FAULTS="name=value,name=value" in a component's environment arms these hooks (unset: every
hook is a no-op dictionary lookup):

  nan_grad_steps=A-B       trainer: the loss of rollout steps A..B (inclusive) is NaN
  slow_checkpoint=STEP:S   trainer: sleep S seconds inside the save of the step-STEP checkpoint, before
                           it is committed
  slow_train_step=STEP:S   trainer: sleep S seconds before training rollout step STEP (its rollouts are
                           committed: a window in which the rollout side has nothing left to do)
  engine_update_delay_s=S  engine: sleep S seconds before joining each weight-update broadcast
  engine_exit_at_request=N engine: exit (status 43) when its N-th /generate request arrives
  engine_decode_delay_s=S   engine: sleep S seconds before each decode step (requests stay in flight long
                           enough for an over-sampled step to abort them mid-turn)
  engine_hold_rid=REGEX    engine: a request whose rid matches is held (never scheduled) until it is aborted,
                           up to the first abort of all requests (later ones run): an over-sampled
                           step's surplus is then cut mid-trajectory whatever the timing
  user_error=ROLE          engine, rollout or trainer: the component of that role dies of a UserError as it
                           starts (what one whose checkpoint no longer matches its config.json does), for
                           the tests of what a deterministic failure ends under each launcher
  engine_router_jitter=EPS engine: add EPS x N(0, 1) to the MoE router's logits, so its live routing
                           differs from the trainer's for some tokens, as a GPU engine's does (a CPU's
                           bf16 kernels may happen to agree)
"""

from __future__ import annotations

import os


def faults() -> dict[str, str]:
    raw = os.environ.get("LOCKSTEP_FAULTS", "")
    return dict(item.split("=", 1) for item in raw.split(",") if "=" in item)


def value(name: str) -> str | None:
    return faults().get(name)


def seconds(name: str) -> float:
    v = value(name)
    return float(v) if v else 0.0


def in_range(name: str, n: int) -> bool:
    """True when `n` lies in the inclusive range A-B (or equals A) given for `name`."""
    v = value(name)
    if not v:
        return False
    lo, _, hi = v.partition("-")
    return int(lo) <= n <= int(hi or lo)


def delay_at_s(name: str, step: int) -> float:
    """The S of `name`=STEP:S when `step` is STEP, else 0."""
    v = value(name)
    if not v:
        return 0.0
    at, _, secs = v.partition(":")
    return float(secs or 0) if int(at) == step else 0.0


def slow_checkpoint_s(step: int) -> float:
    return delay_at_s("slow_checkpoint", step)
