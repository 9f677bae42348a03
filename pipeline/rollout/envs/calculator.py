"""A calculator tool: the model may call it, the environment appends the result, the model answers.

Prompt "4+3+1=" (three digits, sum <= 9). Turn 1: the model answers at once, or emits the call token
"?" (a stop token: the turn ends there). On a call the environment appends the delimiter
<|im_start|> (as an id) and the tokenization of the result text alone ("8"), and the model answers in
turn 2. Reward: 1 for the right answer (its leading integer), plus `CALL_BONUS` for a well-formed call
(the call turn is exactly "?"): the format is learned by RL alone, from a random initialisation.
Tool tokens are appended with loss mask 0: they get no gradient.
"""

from __future__ import annotations

from pipeline.rollout.base import EngineHandle, RolloutSample
from pipeline.rollout.rewards import arith_reward
from pipeline.rollout.trajectory import Trajectory

CALL = "?"
CALL_BONUS = 0.2


def rows() -> list[dict]:
    """Every a+b+c= with a sum of at most 9 (220 problems)."""
    return [{"prompt": f"{a}+{b}+{c}=", "label": str(a + b + c), "metadata": {"terms": [a, b, c]}}
            for a in range(10) for b in range(10) for c in range(10) if a + b + c <= 9]


def calculate(terms: list[int]) -> str:
    return str(sum(terms))


def generate(sample: RolloutSample, engine: EngineHandle) -> Trajectory:
    tok = sample.tokenizer
    call_id = tok.token_to_id(CALL)
    traj = Trajectory.start(sample)
    first, _, _, finish = traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 2,
                                                                     "stop_token_ids": [call_id]}))
    called = bool(first) and first[-1] == call_id and finish == "stop"
    answer = first
    if called:
        traj.add_env([tok.token_to_id("<|im_start|>")])  # a template delimiter, as an id
        traj.add_text(tok, calculate(sample.metadata["terms"]))  # the tool's text alone, encoded once
        answer, _, _, _ = traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 2}))
    correct = arith_reward(tok.decode(answer, skip_special_tokens=True), sample.label, sample.metadata)
    well_formed = called and first == [call_id]
    traj.reward = correct + CALL_BONUS * well_formed
    traj.reward_components = {"correct": correct, "tool_call": float(called)}
    traj.finish_reason = "stop"
    return traj
