"""The rollout-function boundary: what a user's `rollout.generate_fn` receives and calls.

A rollout function turns one sample into one trajectory:

    def generate(sample: RolloutSample, engine: EngineHandle) -> Trajectory      # or `async def`

`engine.generate(token_ids, sampling_params)` runs one turn on the sample's engine (all turns of a
group go to the same engine, so its prefix cache holds the conversation) and returns
`(new_ids, logprobs, routed_experts, finish_reason)`; with an `async def` function it is awaited.
The trajectory is built by appending token ids only (pipeline/rollout/trajectory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class TurnAborted(Exception):
    """The engine aborted a turn (the step had enough groups). Let it propagate out of the rollout function:
    with rollout.partial_rollout the trajectory resumes at that turn next step (earlier turns are replayed
    from what they produced; see EngineHandle)."""


@dataclass
class RolloutSample:
    """One sample of a group: the prompt as token ids, its label and metadata, and what a turn may use."""

    prompt_ids: list[int]
    label: Any
    metadata: dict
    tokenizer: Any  # pipeline.models.tokenizer.Tokenizer: encode the environment's text alone with it
    group_id: int = 0
    sample_idx: int = 0
    prompt_text: str = ""
    max_response_len: int = 0
    """Most tokens after the prompt (generated and appended); a turn past it ends as `length`."""
    extra: dict = field(default_factory=dict)


TurnResult = tuple[list[int], list[float], "np.ndarray | None", str]
"""(new_ids, logprobs, routed_experts [len(input)+len(new)-1, L, k] or None, finish_reason)."""


class EngineHandle(Protocol):
    """One sample's way to the engines (session-sticky)."""

    def generate(self, token_ids: list[int], sampling_params: dict | None = None) -> TurnResult: ...
