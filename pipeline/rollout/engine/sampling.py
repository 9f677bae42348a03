"""Seeded, batch-invariant sampling: Gumbel-max with counter-based noise.

Each request carries a sampling seed. The noise for its token at output position p and vocab entry v
is a hash of (seed, p, v) — no generator state — so a request samples the same tokens whatever else
is in the batch, on any device, and after a restart. argmax(logits / T + Gumbel) draws exactly from
softmax(logits / T) restricted to the top-k / top-p set.

Legend: B rows (requests), V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lockstep_kernels import GREEDY_EPS, scaled_logits
from lockstep_kernels.dispatch import use_triton

if TYPE_CHECKING:
    from pipeline.rollout.engine.core import Request

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_MASK53 = (1 << 53) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts emulated by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M2
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M3
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x


def hash_uniform(seeds_B: torch.Tensor, positions_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1), [B, V], a pure function of (seed, position, vocab index)."""
    v = torch.arange(vocab, device=seeds_B.device, dtype=torch.int64)
    key = _mix(seeds_B.to(torch.int64) * _M1 + positions_B.to(torch.int64))
    x = _mix(key[:, None] + v[None, :] * _M1)
    bits = (x >> 11) & _MASK53
    return (bits.double() + 0.5) / float(1 << 53)


def truncation_mask(logits_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor) -> torch.Tensor:
    """True for tokens kept by top-k (k<=0: all) and top-p (the smallest set with mass >= p)."""
    sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = probs.cumsum(-1)
    rank = torch.arange(logits_BV.shape[-1], device=logits_BV.device)[None, :]
    keep_sorted = (cum - probs) < top_p_B[:, None].to(cum.dtype)  # mass before this token < p
    keep_sorted &= (top_k_B[:, None] <= 0) | (rank < top_k_B[:, None])
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    seeds_B: torch.Tensor,
    positions_B: torch.Tensor,
    truncated: bool | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """Next token per row. Rows with temperature ~0 take the argmax. truncated: whether any row uses
    top-p/top-k, when the caller knows it (None: read from the device, a synchronisation).

    fused (engine.sampling_backend=triton, the default): on GPUs a batch without top-p/top-k takes the
    fused Triton sampler (lockstep_kernels/gpu/sampling.py), the same tokens as the torch path
    (tests/triton_checks.py sampling, on the H200 at vocab 151936); decode with it 1.2-1.5x at batch 64
    and 1.6-2.2x at batch 256 over three runs, within noise at batch 1-16 (bench/engine_bench.py
    --fused-sampling)."""
    truncated_B = (top_p_B < 1.0) | (top_k_B > 0)
    if truncated is None:
        truncated = bool(truncated_B.any())
    if not truncated and fused and use_triton(logits_BV):  # one fused pass on GPUs, the same tokens
        from lockstep_kernels.gpu.sampling import gumbel_argmax

        return gumbel_argmax(logits_BV, temperature_B, seeds_B, positions_B, GREEDY_EPS)
    scaled = scaled_logits(logits_BV, temperature_B)
    if truncated:
        # Rows that asked for no truncation keep every token: a row's tokens never depend on whether
        # another request in the batch uses top-p/top-k (a mask at p=1 can drop tokens whose
        # cumulative probability rounds to 1).
        keep = truncation_mask(scaled, top_p_B, top_k_B) | ~truncated_B[:, None]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    gumbel = -torch.log(-torch.log(hash_uniform(seeds_B, positions_B, logits_BV.shape[-1])))
    noisy = scaled.double() + gumbel
    greedy = temperature_B < GREEDY_EPS
    noisy = torch.where(greedy[:, None], scaled.double(), noisy)
    return noisy.argmax(-1)


def to_device(t: torch.Tensor, device, pinned: bool) -> torch.Tensor:
    """A host tensor onto the device; `pinned` (overlapped decode): from pinned memory, non-blocking (a
    copy from pageable memory first waits for everything queued on the stream: it would end the overlap)."""
    if torch.device(device).type != "cuda" or not pinned:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sampling_rows(reqs: list[Request], device, per_request: int = 1, ahead: int = 0, pinned: bool = False) -> dict:
    """`sample()`'s per-row arguments for `per_request` consecutive output positions of each request,
    starting at its next one, `ahead` past it (tokens sampled but not read back yet) (rows request-major:
    a request's positions are adjacent). Built on the host and moved in two copies (pinned: see
    `to_device`); `truncated` (any row with top-p/top-k) is known without reading the device."""
    floats = torch.tensor([[r.params.temperature for r in reqs], [r.params.top_p for r in reqs]], dtype=torch.float32)
    ints = torch.tensor([[r.params.top_k for r in reqs], [r.seed() for r in reqs],
                         [len(r.output_ids) + ahead for r in reqs]], dtype=torch.int64)
    if per_request > 1:
        floats, ints = floats.repeat_interleave(per_request, 1), ints.repeat_interleave(per_request, 1)
        ints[2] += torch.arange(per_request).repeat(len(reqs))
    floats, ints = to_device(floats, device, pinned), to_device(ints, device, pinned)
    return {"temperature_B": floats[0], "top_p_B": floats[1], "top_k_B": ints[0], "seeds_B": ints[1],
            "positions_B": ints[2], "truncated": any(r.params.top_p < 1.0 or r.params.top_k > 0 for r in reqs)}
