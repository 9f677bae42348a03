"""Gumbel-max sampling in one pass over the logits, in Triton (pipeline/rollout/engine/sampling.py's
noise, bit for bit).

`_gumbel_argmax_kernel`: a (row, vocab chunk) grid; each program walks its chunk in blocks: logits / T
(IEEE division, as torch), the counter-based noise of (seed, position, vocab id) (splitmix64 on int64,
as `_mix`), -log(-log(u)) in fp64, and a running best with its first index per lane; the first best
chunk of a row then gives its token. Chunks make a batch-1 step use the whole GPU instead of one SM.
The torch path materialises a dozen [B, V]
int64/fp64 temporaries for the same result (at batch 256 and a 152k vocab, ~0.6 GB of memory traffic
each). Rows that ask for top-p/top-k take the torch path (it sorts).

On by default on GPUs (engine.sampling_backend=pytorch: off). `python tests/triton_checks.py sampling` (part of
bench/gpu_suite.sh checks) compares it token for token with the torch path: equal on the H200 at batch
1/64/256, vocab 151936, fp32 and bf16, and under the CPU interpreter with a split row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.offsets import offset64


@triton.jit
def _mix(x):
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, V, chunk, n_chunks,
                          greedy_eps, BLOCK: tl.constexpr):
    """Program (row, c) takes vocab entries [c * chunk, (c + 1) * chunk) of its row: the largest noisy
    logit there and its first index."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    greedy = temp < greedy_eps
    t = tl.where(greedy, 1.0, temp)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    key = _mix(seed * -7046029254386353131 + pos)
    # Each lane keeps its own running best (strictly greater: a lane sees its indices in increasing
    # order, so it keeps the first); one reduction at the end instead of two per block.
    lane_best = tl.full((BLOCK,), float("-inf"), tl.float64)
    lane_idx = tl.zeros((BLOCK,), tl.int64)
    logits_row = logits_ptr + offset64(row, stride)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)
    for start in range(lo, hi, BLOCK):
        v = start + tl.arange(0, BLOCK)
        mask = v < hi
        x = tl.load(logits_row + v, mask=mask, other=0.0).to(tl.float32)
        scaled = tl.math.div_rn(x, tl.zeros_like(x) + t).to(tl.float64)
        h = _mix(key + v.to(tl.int64) * -7046029254386353131)
        u = (((h >> 11) & ((1 << 53) - 1)).to(tl.float64) + 0.5) / 9007199254740992.0
        noisy = tl.where(greedy, scaled, scaled + -tl.log(-tl.log(u)))
        better = mask & (noisy > lane_best)
        lane_idx = tl.where(better, v.to(tl.int64), lane_idx)
        lane_best = tl.where(better, noisy, lane_best)
    best = tl.max(lane_best, axis=0)
    # the first index among the lanes that reached the best (V: none, an empty chunk)
    best_idx = tl.min(tl.where(lane_best == best, lane_idx, V), axis=0)
    tl.store(best_ptr + offset64(row, n_chunks) + c, best)
    tl.store(idx_ptr + offset64(row, n_chunks) + c, best_idx)


BLOCK = 2048


def split_of(b: int, v: int, programs: int) -> tuple[int, int]:
    """(chunk, n_chunks): each row's vocab cut into whole blocks so that the grid has about `programs`
    programs (a batch-1 decode step still fills the GPU; a batch of 256 keeps rows whole-ish)."""
    blocks = triton.cdiv(v, BLOCK)
    n = max(1, min(blocks, triton.cdiv(programs, max(b, 1))))
    chunk = triton.cdiv(blocks, n) * BLOCK
    return chunk, triton.cdiv(v, chunk)


def gumbel_argmax(logits_BV: torch.Tensor, temperature_B: torch.Tensor, seeds_B: torch.Tensor,
                  positions_B: torch.Tensor, greedy_eps: float) -> torch.Tensor:
    """Per row: argmax of logits / T + Gumbel noise (the first index among equals, as torch.argmax),
    in two steps: each program the best of its vocab chunk, then the first best chunk per row."""
    b, v = logits_BV.shape
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    if not b:
        return torch.empty(0, dtype=torch.int64, device=logits_BV.device)
    programs = 2 * torch.cuda.get_device_properties(logits_BV.device).multi_processor_count \
        if logits_BV.is_cuda else 4
    chunk, n = split_of(b, v, programs)
    best = torch.empty(b, n, dtype=torch.float64, device=logits_BV.device)
    idx = torch.empty(b, n, dtype=torch.int64, device=logits_BV.device)
    _gumbel_argmax_kernel[(b, n)](logits_BV, logits_BV.stride(0), temperature_B.contiguous(), seeds_B.contiguous(),
                                  positions_B.contiguous(), best, idx, v, chunk, n, greedy_eps, BLOCK=BLOCK,
                                  num_warps=8)
    if n == 1:
        return idx[:, 0]
    return idx.gather(1, best.argmax(1, keepdim=True))[:, 0]
