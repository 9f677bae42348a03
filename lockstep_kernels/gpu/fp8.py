"""Blockwise FP8 quantisation in Triton (same bits as lockstep_kernels/fp8_ref.py's torch reference).

`_quant_kernel`: one program per 128 x 128 block: amax over the block, scale_inv = amax / 448 (1 for
an all-zero block), q = clamp(x / scale_inv, +-448) cast to e4m3 with round-to-nearest-even.
`_dequant_kernel`: one program per block, w = q * scale_inv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.fp8_ref import E4M3_MAX, FP8, num_blocks
from lockstep_kernels.gpu.offsets import offset64


@triton.jit
def _quant_kernel(w_ptr, q_ptr, s_ptr, M, N, stride_w, stride_q, n_col_blocks, MAX: tl.constexpr,
                  BLOCK: tl.constexpr):
    bm = tl.program_id(0)
    bn = tl.program_id(1)
    local = tl.arange(0, BLOCK)
    rows = bm * BLOCK + local
    cols = bn * BLOCK + local
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    # the block's first row in int64 (offsets.py); rows within the block stay int32
    w_block = w_ptr + offset64(bm * BLOCK, stride_w) + local[:, None] * stride_w + cols[None, :]
    q_block = q_ptr + offset64(bm * BLOCK, stride_q) + local[:, None] * stride_q + cols[None, :]
    x = tl.load(w_block, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale_inv = tl.where(amax > 0, tl.math.div_rn(amax, MAX), 1.0)  # IEEE division, as torch's
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale_inv), -MAX), MAX)
    tl.store(q_block, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + offset64(bm, n_col_blocks) + bn, scale_inv)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, w_ptr, M, N, stride_q, stride_w, n_col_blocks, BLOCK: tl.constexpr):
    bm = tl.program_id(0)
    bn = tl.program_id(1)
    local = tl.arange(0, BLOCK)
    rows = bm * BLOCK + local
    cols = bn * BLOCK + local
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    q_block = q_ptr + offset64(bm * BLOCK, stride_q) + local[:, None] * stride_q + cols[None, :]
    w_block = w_ptr + offset64(bm * BLOCK, stride_w) + local[:, None] * stride_w + cols[None, :]
    q = tl.load(q_block, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offset64(bm, n_col_blocks) + bn)
    tl.store(w_block, (q * s).to(w_ptr.dtype.element_ty), mask=mask)


def quantize_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    assert w.dim() == 2, f"blockwise FP8 needs a 2-D weight, got shape {tuple(w.shape)}"
    if w.stride(-1) != 1:  # rows may sit apart (a view of a larger tensor); columns must be adjacent
        w = w.contiguous()
    M, N = w.shape
    bm, bn = num_blocks(M, block), num_blocks(N, block)
    q = torch.empty((M, N), dtype=FP8, device=w.device)
    s = torch.empty((bm, bn), dtype=torch.float32, device=w.device)
    _quant_kernel[(bm, bn)](w, q, s, M, N, w.stride(0), q.stride(0), bn, MAX=E4M3_MAX, BLOCK=block)
    return q, s


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = 128) -> torch.Tensor:
    if q.stride(-1) != 1:
        q = q.contiguous()
    M, N = q.shape
    w = torch.empty((M, N), dtype=dtype, device=q.device)
    bm, bn = num_blocks(M, block), num_blocks(N, block)
    _dequant_kernel[(bm, bn)](q, scale_inv.contiguous(), w, M, N, q.stride(0), w.stride(0), bn, BLOCK=block)
    return w
