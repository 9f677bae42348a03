"""The default rollout function (rollout.generate_fn): one prompt, one generate call, one response."""

from __future__ import annotations

from pipeline.rollout.base import EngineHandle, RolloutSample
from pipeline.rollout.trajectory import Trajectory


def generate(sample: RolloutSample, engine: EngineHandle) -> Trajectory:
    """Prompt ids in, response ids out; rollout.rm_type scores the response (the reward is left None)."""
    traj = Trajectory.start(sample)
    traj.add_turn(engine.generate(traj.tokens))
    return traj
