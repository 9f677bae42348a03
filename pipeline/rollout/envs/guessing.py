"""A guessing game with feedback: find a secret digit in at most `MAX_GUESSES` guesses.

Each turn the model guesses one token; the environment appends "+" (the secret is higher), "-" (lower)
or "x" (not a digit) after the delimiter <|im_start|> (an id). Reward 1 - 0.2 * (guesses - 1) when the
secret is found, 0 otherwise: a policy that reads the feedback (binary search) earns ~0.7, one that
guesses blindly ~0.3 (random digits without repeats: less).
"""

from __future__ import annotations

from pipeline.rollout.base import EngineHandle, RolloutSample
from pipeline.rollout.trajectory import Trajectory

MAX_GUESSES = 4


def rows(copies: int = 8) -> list[dict]:
    """`copies` rows per secret 0..9 (prompt text the same: the secret is only in the label)."""
    return [{"prompt": "guess:", "label": str(s), "metadata": {"copy": c}} for c in range(copies) for s in range(10)]


def feedback(guess: str, secret: int) -> str:
    if not guess.isdigit():
        return "x"
    return "+" if secret > int(guess) else "-"


def generate(sample: RolloutSample, engine: EngineHandle) -> Trajectory:
    tok = sample.tokenizer
    secret = int(sample.label)
    traj = Trajectory.start(sample)
    found_at = 0
    for k in range(1, MAX_GUESSES + 1):
        ids, _, _, _ = traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 1}))
        guess = tok.decode(ids, skip_special_tokens=True)
        if guess == str(secret):
            found_at = k
            break
        if k < MAX_GUESSES:
            traj.add_env([tok.token_to_id("<|im_start|>")])
            traj.add_text(tok, feedback(guess, secret))
    traj.reward = 1.0 - 0.2 * (found_at - 1) if found_at else 0.0
    traj.reward_components = {"found": float(found_at > 0), "guesses": float(found_at or MAX_GUESSES)}
    traj.finish_reason = "stop"
    return traj
