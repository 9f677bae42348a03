"""Batch-invariant RMSNorm in Triton: y = w * (x * rsqrt(mean(x^2) + eps)) per row.

Layers: `_rms_norm_kernel` (one program per row, the whole row in one block), `rms_norm_fwd` (launcher),
`BiRMSNorm` (autograd: backward by recomputing the torch formula), `bi_rms_norm` (wrapper). A row is
reduced alone, in a block size that depends only on the hidden size, so its result never depends on
how many rows are normalised together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels import torch_ref
from lockstep_kernels.gpu.offsets import offset64


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    """y[r] = w * cast(x[r] * rsqrt(sum(x[r]^2) / N + eps)), fp32 inside."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + offset64(row, stride_x) + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    xn = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offset64(row, stride_y) + cols, (w * xn).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        n = x2.shape[1]
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), n, eps,
                                         BLOCK_N=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return y.reshape(shape)


class BiRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_fwd(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = torch_ref.rms_norm(xr, wr, ctx.eps)
            gx, gw = torch.autograd.grad(out, (xr, wr), grad)
        return gx, gw, None


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return BiRMSNorm.apply(x, weight, eps)
