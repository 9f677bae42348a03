"""A guessing game with feedback: find a secret digit in at most `MAX_GUESSES` guesses.

Each turn the model guesses one token; the environment appends "+" (the secret is higher), "-" (lower)
or "x" (not a digit) after the delimiter <|im_start|> (an id). Reward 1 - 0.2 * (guesses - 1) when the
secret is found, 0 otherwise: a policy that reads the feedback (binary search) earns 0.62, one that
guesses four distinct digits blindly 0.28. `consistent` (a reward component, not rewarded) is the
fraction of follow-up guesses inside the range the feedback left: ~0.6 for distinct digits guessed
blindly, 1.0 for a policy that reads the feedback.
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
    low, high = 0, 9  # what the feedback so far allows
    consistent = []  # per follow-up guess: inside the range the feedback left
    for k in range(1, MAX_GUESSES + 1):
        ids, _, _, _ = traj.add_turn(engine.generate(traj.tokens, {"max_new_tokens": 1}))
        guess = tok.decode(ids, skip_special_tokens=True)
        if k > 1:
            consistent.append(float(guess.isdigit() and low <= int(guess) <= high))
        if guess == str(secret):
            found_at = k
            break
        if guess.isdigit():
            low, high = (max(low, int(guess) + 1), high) if secret > int(guess) else (low, min(high, int(guess) - 1))
        if k < MAX_GUESSES:
            traj.add_env([tok.token_to_id("<|im_start|>")])
            traj.add_text(tok, feedback(guess, secret))
    traj.reward = 1.0 - 0.2 * (found_at - 1) if found_at else 0.0
    traj.reward_components = {"found": float(found_at > 0), "guesses": float(found_at or MAX_GUESSES)}
    if consistent:  # NaN-free mean over samples that had a follow-up guess
        traj.reward_components["consistent"] = sum(consistent) / len(consistent)
    traj.finish_reason = "stop"
    return traj
