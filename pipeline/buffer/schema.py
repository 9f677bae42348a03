"""The rollout shard schema (version 1): flat columns with offsets, one HDF5 file per producer per step.

Columns (S samples, T = total tokens, R = total response tokens, L MoE layers, k top-k):
  tokens          int32  [T]    prompt then response tokens of each sample, back to back
  sample_offsets  int64  [S+1]  sample i is tokens[sample_offsets[i]:sample_offsets[i+1]]
  prompt_len      int32  [S]
  response_len    int32  [S]
  loss_mask       uint8  [R]    1 = train on this response token
  logprobs        float32[R]    engine logprob of each response token
  rewards         float32[S]    scalar reward (reward_components/<name> float32 [S] beside it)
  group_id        int64  [S]    samples of one prompt share a group (GRPO normalises within it)
  sample_idx      int32  [S]    index within the group
  prompt_idx      int64  [S]    row of the prompt in the dataset
  weight_version  int64  [S]    policy version that generated the sample
  status          uint8  [S]    0 completed, 1 truncated, 2 aborted (partial, continued later),
                                3 failed (reward function raised), 4 deferred (finished, group aborted)
  metadata        str    [S]    JSON per sample
  routed_experts  uint8/uint16 [T-S, L, k]  (MoE only) experts of every token but each sample's last
File attributes: schema_version, model_id, step, producer, created, num_moe_layers, top_k, num_experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

SCHEMA_VERSION = 1


class SampleStatus(IntEnum):
    """A sample's state; the value is what the shard's `status` column stores (uint8)."""

    COMPLETED = 0  # stopped on a stop token
    TRUNCATED = 1  # reached the length limit
    ABORTED = 2  # generation cut off (partial rollout, continued later)
    FAILED = 3  # the reward function raised
    DEFERRED = 4  # finished, but its group was aborted: waits for the group (its final status in metadata)

    @property
    def label(self) -> str:
        """The lowercase name (metadata's final_status, `lockstep buffer` output)."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> "SampleStatus":
        return cls[label.upper()]


TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)  # aborted/deferred wait for their group

REQUIRED_COLUMNS = (
    "tokens", "sample_offsets", "prompt_len", "response_len", "loss_mask", "logprobs", "rewards",
    "group_id", "sample_idx", "prompt_idx", "weight_version", "status", "metadata",
)
PER_SAMPLE = ("prompt_len", "response_len", "rewards", "group_id", "sample_idx", "prompt_idx", "weight_version", "status")


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer type that holds expert ids 0..num_experts-1."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


@dataclass
class Sample:
    """One finished (or aborted) response, as the rollout manager builds it."""

    group_id: int
    sample_idx: int
    prompt_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0
    status: SampleStatus = SampleStatus.COMPLETED
    metadata: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None
    routed_experts: np.ndarray | None = None  # [len(prompt)+len(response)-1, L, k]

    def __post_init__(self):
        assert len(self.logprobs) == len(self.response_ids), "one logprob per response token"
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)


@dataclass
class RolloutBatch:
    """Columnar samples (see module docstring). Per-sample arrays have length S."""

    tokens: np.ndarray
    sample_offsets: np.ndarray
    prompt_len: np.ndarray
    response_len: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    group_id: np.ndarray
    sample_idx: np.ndarray
    prompt_idx: np.ndarray
    weight_version: np.ndarray
    status: np.ndarray
    metadata: list[str]
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def response_offsets(self) -> np.ndarray:
        out = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.response_len, out=out[1:])
        return out

    @property
    def routed_offsets(self) -> np.ndarray:
        """Sample i's routing rows are routed_experts[routed_offsets[i]:routed_offsets[i+1]]."""
        return self.sample_offsets - np.arange(len(self) + 1)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.sample_offsets[i]: self.sample_offsets[i + 1]]

    def response_slice(self, i: int) -> slice:
        ro = self.response_offsets
        return slice(int(ro[i]), int(ro[i + 1]))

    def routing(self, i: int) -> np.ndarray | None:
        if self.routed_experts is None:
            return None
        ro = self.routed_offsets
        return self.routed_experts[ro[i]: ro[i + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self.sample_offsets[-1])

    @classmethod
    def from_samples(cls, samples: list[Sample], num_experts: int = 0) -> "RolloutBatch":
        n = len(samples)
        lengths = np.array([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        cat = lambda xs, dt: np.concatenate([np.asarray(x, dtype=dt) for x in xs]) if xs else np.zeros(0, dt)  # noqa: E731
        comps = sorted({k for s in samples for k in s.reward_components})
        routed = None
        if samples and all(s.routed_experts is not None for s in samples) and num_experts:
            routed = np.concatenate([s.routed_experts for s in samples]).astype(expert_dtype(num_experts))
            assert len(routed) == offsets[-1] - n, "routing rows must cover every token but each sample's last"
        return cls(
            tokens=cat([list(s.prompt_ids) + list(s.response_ids) for s in samples], np.int32),
            sample_offsets=offsets,
            prompt_len=np.array([len(s.prompt_ids) for s in samples], dtype=np.int32),
            response_len=np.array([len(s.response_ids) for s in samples], dtype=np.int32),
            loss_mask=cat([s.loss_mask for s in samples], np.uint8),
            logprobs=cat([s.logprobs for s in samples], np.float32),
            rewards=np.array([s.reward for s in samples], dtype=np.float32),
            group_id=np.array([s.group_id for s in samples], dtype=np.int64),
            sample_idx=np.array([s.sample_idx for s in samples], dtype=np.int32),
            prompt_idx=np.array([s.prompt_idx for s in samples], dtype=np.int64),
            weight_version=np.array([s.weight_version for s in samples], dtype=np.int64),
            status=np.array([int(s.status) for s in samples], dtype=np.uint8),
            metadata=[json.dumps(s.metadata, sort_keys=True) for s in samples],
            reward_components={k: np.array([s.reward_components.get(k, np.nan) for s in samples], dtype=np.float32)
                               for k in comps},
            routed_experts=routed,
        )

    def select(self, idx: np.ndarray | list[int]) -> "RolloutBatch":
        """A new batch with samples `idx` (in that order)."""
        idx = np.asarray(idx, dtype=np.int64)
        so, ro = self.sample_offsets, self.response_offsets
        take = lambda arr, off: np.concatenate([arr[off[i]:off[i + 1]] for i in idx]) if len(idx) else arr[:0]  # noqa: E731
        lengths = so[1:][idx] - so[:-1][idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        routed = None
        if self.routed_experts is not None:
            routed = take(self.routed_experts, self.routed_offsets)
        return RolloutBatch(
            tokens=take(self.tokens, so), sample_offsets=offsets,
            prompt_len=self.prompt_len[idx], response_len=self.response_len[idx],
            loss_mask=take(self.loss_mask, ro), logprobs=take(self.logprobs, ro),
            rewards=self.rewards[idx], group_id=self.group_id[idx], sample_idx=self.sample_idx[idx],
            prompt_idx=self.prompt_idx[idx], weight_version=self.weight_version[idx], status=self.status[idx],
            metadata=[self.metadata[i] for i in idx],
            reward_components={k: v[idx] for k, v in self.reward_components.items()},
            routed_experts=routed,
        )

    @classmethod
    def concat(cls, batches: list["RolloutBatch"]) -> "RolloutBatch":
        assert batches
        if len(batches) == 1:
            return batches[0]
        lengths = np.concatenate([b.sample_offsets[1:] - b.sample_offsets[:-1] for b in batches])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        comps = sorted({k for b in batches for k in b.reward_components})
        has_routing = all(b.routed_experts is not None for b in batches)
        return cls(
            tokens=np.concatenate([b.tokens for b in batches]), sample_offsets=offsets,
            **{c: np.concatenate([getattr(b, c) for b in batches]) for c in PER_SAMPLE},
            loss_mask=np.concatenate([b.loss_mask for b in batches]),
            logprobs=np.concatenate([b.logprobs for b in batches]),
            metadata=[m for b in batches for m in b.metadata],
            reward_components={k: np.concatenate([b.reward_components.get(k, np.full(len(b), np.nan, np.float32))
                                                  for b in batches]) for k in comps},
            routed_experts=np.concatenate([b.routed_experts for b in batches]) if has_routing else None,
        )
