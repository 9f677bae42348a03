"""Batch-invariant log-softmax and fused per-token logprob in Triton.

Layers: `_log_softmax_kernel` and `_token_logprob_kernel` (one program per row; the vocabulary is
reduced in fixed BLOCK_V chunks from 0 upward), launchers, autograd Functions, wrappers.

`bi_token_logprob(logits, targets, temperature)` returns log softmax(logits / T)[target] for each row
without materialising the [rows, vocab] fp32 log-softmax: one pass for the max, one for the sum of
exponentials, then a gather. Its backward writes (onehot - softmax) / T * grad chunk by chunk, in the
logits' dtype. That is the memory win for vocab 152k (bench/logprob_bench.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.offsets import offset64

BLOCK_V = 4096


@triton.jit
def _row_max_sum(x_row, N, inv_t, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of x_row[0:N] * inv_t, in fixed chunks."""
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32) * inv_t
        m = tl.maximum(m, x)
    mx = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32) * inv_t
        s += tl.exp(x - mx)
    return mx, tl.sum(s, axis=0)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, stride_x, stride_y, N, BLOCK: tl.constexpr):
    """y[r, :] = x[r, :] - max - log(sum(exp(x - max))), fp32 out."""
    row = tl.program_id(0)
    x_row = x_ptr + offset64(row, stride_x)
    y_row = y_ptr + offset64(row, stride_y)
    mx, s = _row_max_sum(x_row, N, 1.0, BLOCK)
    lse = mx + tl.log(s)
    offs = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=0.0).to(tl.float32)
        tl.store(y_row + start + offs, x - lse, mask=start + offs < N)


@triton.jit
def _token_logprob_kernel(x_ptr, t_ptr, inv_t_ptr, out_ptr, lse_ptr, stride_x, N, BLOCK: tl.constexpr):
    """out[r] = x[r, t[r]] / T[r] - logsumexp(x[r, :] / T[r]); also stores the logsumexp for backward."""
    row = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + row)
    x_row = x_ptr + offset64(row, stride_x)
    mx, s = _row_max_sum(x_row, N, inv_t, BLOCK)
    lse = mx + tl.log(s)
    target = tl.load(t_ptr + row)
    xt = tl.load(x_row + target).to(tl.float32) * inv_t
    tl.store(out_ptr + row, xt - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _token_logprob_bwd_kernel(x_ptr, t_ptr, inv_t_ptr, lse_ptr, g_ptr, dx_ptr, stride_x, stride_dx, N,
                              BLOCK: tl.constexpr):
    """dx[r, v] = g[r] * (1[v == t[r]] - softmax(x[r] / T[r])[v]) / T[r]."""
    row = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row).to(tl.float32)
    target = tl.load(t_ptr + row)
    x_row = x_ptr + offset64(row, stride_x)
    dx_row = dx_ptr + offset64(row, stride_dx)
    offs = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(x - lse)
        d = (tl.where(cols == target, 1.0, 0.0) - p) * g * inv_t
        tl.store(dx_row + cols, d.to(dx_ptr.dtype.element_ty), mask=cols < N)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def log_softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, y, x2.stride(0), y.stride(0), x2.shape[1],
                                            BLOCK=min(BLOCK_V, triton.next_power_of_2(x2.shape[1])), num_warps=8)
    return y.reshape(x.shape)


class BiLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = log_softmax_fwd(x)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return (grad - torch.exp(y) * grad.sum(-1, keepdim=True)).to(ctx.in_dtype)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return BiLogSoftmax.apply(x)


class TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_MV, targets_M, inv_t_M):
        x = _rows(logits_MV)
        m, v = x.shape
        out = torch.empty(m, dtype=torch.float32, device=x.device)
        lse = torch.empty(m, dtype=torch.float32, device=x.device)
        t = targets_M.to(torch.int64).contiguous()
        block = min(BLOCK_V, triton.next_power_of_2(v))
        if m:
            _token_logprob_kernel[(m,)](x, t, inv_t_M, out, lse, x.stride(0), v, BLOCK=block, num_warps=8)
        ctx.save_for_backward(x, t, inv_t_M, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_M):
        x, t, inv_t, lse = ctx.saved_tensors
        dx = torch.empty_like(x)
        if x.shape[0]:
            _token_logprob_bwd_kernel[(x.shape[0],)](x, t, inv_t, lse, grad_M.contiguous(), dx, x.stride(0), dx.stride(0),
                                                     x.shape[1], BLOCK=ctx.block, num_warps=8)
        return dx, None, None


def bi_token_logprob(logits_MV: torch.Tensor, targets_M: torch.Tensor, temperature) -> torch.Tensor:
    """temperature: a float or a per-row tensor (values ~0 mean greedy, scored at 1)."""
    m = logits_MV.reshape(-1, logits_MV.shape[-1]).shape[0]
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits_MV.device).expand(m)
    inv_t = torch.where(t < 1e-5, torch.ones_like(t), 1.0 / t).contiguous()
    return TokenLogprob.apply(logits_MV, targets_M, inv_t)
