"""The trainer-backend interface: everything the step loop (loop.py) asks of a training backend.

Two implementations: FSDP2 (fsdp.py) and megatron-core (megatron/backend.py); `factory.make_backend` picks
one by train.backend. What they build alike (optimizer, schedule, update rule) is in optim.py.
Legend: M scored response tokens of a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from pipeline.config.schema import RunConfig
    from pipeline.models.config import ModelArgs
    from pipeline.trainer.batching import MicroBatch


@dataclass
class MtpScores:
    """The MTP head on a micro-batch's response tokens [M]: logprob of each token (at the rollout
    temperature), whether its top guess was that token, and which tokens it is trained on."""

    logp_M: torch.Tensor
    hit_M: torch.Tensor
    mask_M: torch.Tensor


@runtime_checkable
class TrainerBackend(Protocol):
    args: ModelArgs
    """The policy's architecture (is_moe, moe_layers, mtp_num_hidden_layers, ...)."""
    dp_rank: int
    dp_size: int
    dp_group: object
    """Which data this rank trains: ranks of one data-parallel index (megatron's TP / PP groups) read
    the same micro-batches; sums over data run over dp_group (None: all ranks)."""
    loss_scale: float
    """Factor on the loss before backward, so gradients are the sum of the ranks' shares (FSDP
    averages over ranks: its world size; megatron sums: 1)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer | None
    """The checkpointed state (pipeline/trainer/checkpoint.py): policy, its optimizer and schedule;
    PPO's critic and its optimizer (None without PPO)."""
    ref_model: torch.nn.Module | None
    """The frozen initial policy (None unless a KL term needs it)."""

    def logprobs(self, mb: MicroBatch, *, replay: bool = False, want_entropy: bool = False,
                 want_mtp: bool = False) -> tuple:
        """(logp_M, entropy_M or None, MoE routing state or None[, MtpScores if want_mtp]) of the
        policy on the micro-batch's response tokens, at the rollout temperature. replay: R3."""

    def ref_logprobs(self, mb: MicroBatch, *, replay: bool = False) -> torch.Tensor:
        """logp_M of the reference model (no gradient)."""

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """The critic's V(s_t) [M] before each response token."""

    def optimizer_step(self) -> tuple[float, bool]:
        """Reduce and clip gradients, step (policy, and critic), zero them: (grad norm, stepped). A
        non-finite norm skips the update (optim.step_if_finite)."""

    def full_state(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the policy, in `dtype`. Collective: every rank iterates to the end."""

    @property
    def lr(self) -> float:
        """The policy's current learning rate."""
