"""Dynamic batching: balance samples across data-parallel ranks, pack micro-batches under a token budget.

Sequences are packed back to back (no padding); a micro-batch holds whole samples whose total length
is at most max_tokens_per_gpu. The functions are pure and deterministic (ties broken by index), so
every rank computes the same plan from the same rollout without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.buffer.schema import RolloutBatch
from pipeline.models.attention import PackedCausal


def balance_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Greedy longest-first assignment of sample indices to ranks, equalising token counts."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], len(out[k]), k))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(x) for x in out]


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sample indices into bins of at most max_tokens tokens."""
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(f"sample of {lengths[too_long[0]]} tokens exceeds max_tokens_per_gpu ({max_tokens})")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    """Tensors of one packed micro-batch. N stream tokens, M scored (response) tokens, L MoE layers."""

    input_ids_N: torch.Tensor
    positions_N: torch.Tensor
    attn: PackedCausal
    score_pos_M: torch.Tensor  # stream index whose logits predict each response token
    targets_M: torch.Tensor  # the response token ids
    rollout_logp_M: torch.Tensor  # engine logprobs
    mask_M: torch.Tensor  # float loss mask
    adv_M: torch.Tensor
    sample_of_M: torch.Tensor  # local sample index of each scored token
    num_samples: int
    trace_NLk: torch.Tensor | None = None  # engine's experts per stream token (-1: none, route live)
    weight: float = 1.0  # 0 for padding micro-batches that only keep ranks' collectives paired
    len_of_sample: torch.Tensor | None = None  # counted response tokens of each local sample

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_N.numel())


def build_micro_batch(batch: RolloutBatch, idx: list[int], adv_R: np.ndarray, device,
                      with_routing: bool = False, weight: float = 1.0) -> MicroBatch:
    seqs = [batch.sequence(i) for i in idx]
    lengths = [len(s) for s in seqs]
    attn = PackedCausal.from_lengths(lengths, device=device)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    score_pos, targets, rollout_lp, mask, adv, sample_of = [], [], [], [], [], []
    for j, i in enumerate(idx):
        p, r = int(batch.prompt_len[i]), int(batch.response_len[i])
        rs = batch.response_slice(i)
        score_pos.append(starts[j] + np.arange(p - 1, p + r - 1))
        targets.append(seqs[j][p:])
        rollout_lp.append(batch.logprobs[rs])
        mask.append(batch.loss_mask[rs])
        adv.append(adv_R[rs].astype(np.float32))
        sample_of.append(np.full(r, j, dtype=np.int64))
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt)).to(device)  # noqa: E731
    trace = None
    if with_routing and batch.routed_experts is not None:
        rows = []
        for j, i in enumerate(idx):
            routed = batch.routing(i).astype(np.int16)
            last = np.full((1,) + routed.shape[1:], -1, dtype=np.int16)  # a sample's last token: live routing
            rows.append(np.concatenate([routed, last]))
        trace = torch.from_numpy(np.concatenate(rows)).to(device)
    return MicroBatch(
        input_ids_N=torch.from_numpy(np.concatenate(seqs).astype(np.int64)).to(device),
        positions_N=attn.positions,
        attn=attn,
        score_pos_M=cat(score_pos, np.int64),
        targets_M=cat(targets, np.int64),
        rollout_logp_M=cat(rollout_lp, np.float32),
        mask_M=cat(mask, np.float32),
        adv_M=cat(adv, np.float32),
        sample_of_M=cat(sample_of, np.int64),
        num_samples=len(idx),
        trace_NLk=trace,
        weight=weight,
        len_of_sample=torch.tensor([float(batch.loss_mask[batch.response_slice(i)].sum()) for i in idx], device=device),
    )
