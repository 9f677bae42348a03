"""The engine handle a rollout function gets: one sample's turns on the engine pool, recorded and replayable.

Every request goes to the sample's session (its group's engine, whose prefix cache holds the
conversation), with the run's sampling settings and a seed that depends only on (seed, step, group,
sample, turn). Each request is recorded as a `Call`, which the TITO comparator checks against the
final trajectory.

Partial rollouts: when the engine aborts a turn, `TurnAborted` ends the rollout function and the
sample is stored with its calls so far. Next step the function runs again from the start on a handle
that *replays* those calls: a turn whose input equals a recorded call's input gets the recorded
output (no engine request), and the cut turn continues from its partial output. So an environment
that is a function of its inputs (and its seed) resumes a half-finished trajectory where it was cut.
A function whose inputs differ from the record is generated afresh from that turn on.
"""

from __future__ import annotations

import asyncio

from pipeline.rollout import protocol
from pipeline.rollout.base import TurnAborted, TurnResult
from pipeline.rollout.trajectory import Call

FIXED = ("temperature", "top_p", "top_k")  # the trainer scores tokens at the run's sampling settings


def turn_seed(base: int, turn: int) -> int:
    """Turn 0 keeps the sample's seed (single-turn rollouts are unchanged); later turns mix in their index."""
    return base if turn == 0 else (base * 1_000_037 + turn) % (1 << 62)


class PoolHandle:
    """EngineHandle over an EnginePool for one sample (see module docstring)."""

    def __init__(self, pool, *, session: str, rid: str, temperature: float, top_p: float, top_k: int, seed: int,
                 min_version: int, prompt_len: int, max_response_len: int, moe_shape: tuple[int, int] | None = None,
                 replay: list[Call] | None = None):
        self.pool, self.session, self.rid = pool, session, rid
        self.defaults = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.seed, self.min_version, self.moe_shape = seed, min_version, moe_shape
        self.prompt_len, self.max_response_len = prompt_len, max_response_len
        self.replay = list(replay or [])
        self.calls: list[Call] = []
        self.turns = 0
        self.replayed = 0
        self.replay_diverged = False

    def generate(self, token_ids: list[int], sampling_params: dict | None = None) -> TurnResult:
        user = dict(sampling_params or {})
        for k in FIXED:
            if k in user and user[k] != self.defaults[k]:
                raise ValueError(f"sampling_params[{k!r}]={user[k]!r} differs from the run's rollout setting"
                                 f" ({self.defaults[k]!r}): the trainer scores tokens at the run's settings; set"
                                 " rollout.rollout_temperature / rollout_top_p / rollout_top_k instead")
        ids = [int(t) for t in token_ids]
        turn, self.turns = self.turns, self.turns + 1
        out, logprobs, routed = [], [], None
        while True:
            cur = ids + out
            budget = self.max_response_len - (len(cur) - self.prompt_len)
            want = int(user.get("max_new_tokens", budget)) - len(out)
            call = self._replayed(cur)
            if call is None:
                if min(budget, want) <= 0:
                    return out, logprobs, routed, "length"
                call = self._request(cur, user, min(budget, want), turn)
            self.calls.append(call)
            out, logprobs = out + call.output_ids, logprobs + call.logprobs
            routed = call.routed if call.routed is not None else routed
            if call.finish_reason != "abort":
                return out, logprobs, routed, call.finish_reason
            if not call.replayed:
                raise TurnAborted(f"{self.rid}: turn {turn} aborted after {len(out)} tokens")

    def _replayed(self, cur: list[int]) -> Call | None:
        if self.replayed >= len(self.replay) or self.replay_diverged:
            return None
        call = self.replay[self.replayed]
        if call.input_ids != cur:
            self.replay_diverged = True  # the function asked something else this time: generate from here
            return None
        self.replayed += 1
        call.replayed = True
        return call

    def _request(self, cur: list[int], user: dict, max_new: int, turn: int) -> Call:
        params = protocol.sampling_params(
            max_new_tokens=max_new, seed=turn_seed(self.seed, turn), **self.defaults)
        for k in ("stop_token_ids", "ignore_eos", "stop"):
            if k in user:
                params[k] = user[k]
        (gen,) = self.pool.generate([cur], [params], min_version=self.min_version, return_logprob=True,
                                    return_routed_experts=self.moe_shape is not None, moe_shape=self.moe_shape,
                                    rid=[f"{self.rid}-t{len(self.calls)}"], session=self.session)
        return Call(cur, list(gen.output_ids), list(gen.logprobs), gen.routed_experts, gen.finish_reason,
                    gen.weight_version if gen.weight_version is not None else 0, gen.cached_tokens,
                    gen.spec_verify_ct)


class AsyncHandle:
    """The same handle for an `async def` rollout function: `await engine.generate(...)`."""

    def __init__(self, handle: PoolHandle):
        self.handle = handle

    async def generate(self, token_ids: list[int], sampling_params: dict | None = None) -> TurnResult:
        return await asyncio.to_thread(self.handle.generate, token_ids, sampling_params)
