"""Which samples this rank trains, and in which micro-batches: one rollout step's plan.

A rollout batch splits into mini-batches, one optimizer step each (in sample order). Each mini-batch's
samples are balanced across the data-parallel ranks by tokens (batching.balance_across_ranks) and
packed into micro-batches under a token budget (batching.pack_micro_batches). Every rank computes
the same split from the same batch; ranks only agree on the micro-batch count (padding with weight-0
micro-batches, so FSDP's collectives pair up), and on the global counts the loss is normalised by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pipeline.buffer.schema import RolloutBatch
from pipeline.config.schema import RunConfig
from pipeline.trainer.base import TrainerBackend
from pipeline.trainer.batching import balance_across_ranks, pack_micro_batches
from pipeline.trainer.metrics import all_reduce

MicroPlan = tuple[list[int], float]
"""One micro-batch: its samples (batch indices) and its weight (0: padding that only keeps ranks'
collectives paired)."""
Plan = list[MicroPlan]
"""This rank's micro-batches of one mini-batch (one optimizer step)."""


@dataclass(frozen=True)
class GlobalCounts:
    """What a mini-batch's loss reduction divides by, over all ranks (algo.loss_reduction)."""

    tokens: float
    samples: float
    max_len: int


@dataclass
class Planner:
    """Plans rollout batches for this data-parallel rank."""

    dp_rank: int
    dp_size: int
    dp_group: object
    device: torch.device
    num_minibatches: int
    """Optimizer steps per rollout step."""
    min_max_len: int = 0
    """A floor under GlobalCounts.max_len (Dr. GRPO's constant normaliser: the response length limit)."""

    @classmethod
    def for_backend(cls, cfg: RunConfig, b: TrainerBackend, device: torch.device) -> Planner:
        """Ranks of one tensor-parallel group (megatron) read the same data: plans and sums run over DP."""
        floor = cfg.rollout.rollout_max_response_len if cfg.algo.loss_reduction == "seq_mean_token_sum" else 0
        return cls(b.dp_rank, b.dp_size, b.dp_group, device, cfg.optimizer_steps_per_rollout, min_max_len=floor)

    def plan(self, batch: RolloutBatch, budget: int) -> list[Plan]:
        """This rank's micro-batches of every mini-batch, each under `budget` tokens. Collective."""
        lengths = (batch.sample_offsets[1:] - batch.sample_offsets[:-1]).tolist()
        return [self.micro_batches([lengths[i] for i in mini], mini, budget)
                for mini in np.array_split(np.arange(len(batch)), self.num_minibatches)]

    def micro_batches(self, lengths: list[int], indices: np.ndarray, budget: int) -> Plan:
        """This rank's share of the samples `indices` (of `lengths` tokens) packed into micro-batches.
        Ranks agree on the count: a rank with fewer runs extra weight-0 micro-batches."""
        mine = balance_across_ranks(lengths, self.dp_size)[self.dp_rank]
        bins = pack_micro_batches([lengths[i] for i in mine], budget)
        plan = [([int(indices[mine[i]]) for i in bin_], 1.0) for bin_ in bins]
        (n,) = all_reduce([len(plan)], self.device, op=dist.ReduceOp.MAX)
        return plan + [([int(indices[0])], 0.0)] * (int(n) - len(plan))

    def counts(self, batch: RolloutBatch, plan: Plan) -> GlobalCounts:
        """Counted tokens, samples and the longest response of a mini-batch over all ranks. Collective."""
        tokens = sum(w * float(batch.loss_mask[batch.response_slice(i)].sum()) for mb, w in plan for i in mb)
        samples = sum(w * len(mb) for mb, w in plan)
        longest = max((int(batch.response_len[i]) for mb, w in plan if w for i in mb), default=0)
        tokens, samples = all_reduce([tokens, samples], self.device, group=self.dp_group)
        (longest,) = all_reduce([longest], self.device, op=dist.ReduceOp.MAX)
        return GlobalCounts(tokens, samples, int(max(longest, self.min_max_len)))


def local_samples(plans: list[Plan]) -> list[int]:
    """The samples this rank trains on (weight-0 padding excluded), sorted."""
    return sorted({i for plan in plans for mb, w in plan if w for i in mb})
