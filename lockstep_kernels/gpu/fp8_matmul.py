"""FP8 W8A8 GEMM with DeepSeek-V3 block scaling, in Triton (inference; the built-in engine's FP8 path).

Layers: `_act_quant_kernel` (one program per (token, 128-channel group): amax, scale = amax / 448,
e4m3 cast), `_w8a8_kernel` (tiles of BLOCK_M tokens x BLOCK_N outputs; each 128-wide k-block's
e4m3 product goes through the tensor cores and is scaled by the token's and the weight block's scales
in fp32; with SPLIT_K > 1 programs share the k-blocks and add into an fp32 buffer, so decode batches
of a few tokens still fill the GPU), `fp8_linear` (launcher). Same quantisation as
lockstep_kernels/fp8_ref.py's reference (which tests compare against).
Legend: M tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.fp8_ref import BLOCK, E4M3_MAX, FP8, num_blocks, quantize_act_ref
from lockstep_kernels.gpu.attention import INTERPRET
from lockstep_kernels.gpu.offsets import offset64


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, sx_m, sq_m, ss_m, MAX: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    kb = tl.program_id(1)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + offset64(m, sx_m) + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, MAX), 1.0)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -MAX), MAX)
    tl.store(q_ptr + offset64(m, sq_m) + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + offset64(m, ss_m) + kb, scale)


@triton.jit
def _w8a8_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, bias_ptr, M, N, K, sa_m, ssa_m, sb_n, ssb_n, sc_m,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start_m = pid_m * BLOCK_M
    start_n = pid_n * BLOCK_N
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    rm = start_m + lm
    rn = start_n + ln
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    # The tile's first token and output row in int64 (offsets.py); offsets within the tile stay int32.
    a_tile = a_ptr + offset64(start_m, sa_m) + lm[:, None] * sa_m
    b_tile = b_ptr + offset64(start_n, sb_n) + ln[:, None] * sb_n
    sa_tile = sa_ptr + offset64(start_m, ssa_m) + lm * ssa_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    nk = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(nk, SPLIT_K)
    for kb in range(pid_k * per, tl.minimum(pid_k * per + per, nk)):
        ks = kb * BLOCK_K + rk
        kmask = ks < K
        a = tl.load(a_tile + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_tile + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        s_a = tl.load(sa_tile + kb, mask=mmask, other=0.0)
        s_b = tl.load(sb_ptr + (rn // BLOCK_K) * ssb_n + kb, mask=nmask, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * s_a[:, None] * s_b[None, :]
    mask = mmask[:, None] & nmask[None, :]
    ptrs = c_ptr + offset64(start_m, sc_m) + lm[:, None] * sc_m + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def quantize_act(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x2.shape
    kb = num_blocks(K)
    q = torch.empty((M, K), dtype=FP8, device=x2.device)
    s = torch.empty((M, kb), dtype=torch.float32, device=x2.device)
    if M:
        _act_quant_kernel[(M, kb)](x2, q, s, K, x2.stride(0), q.stride(0), s.stride(0), MAX=E4M3_MAX, BLOCK=BLOCK)
    return q, s


def split_k_for(grid_mn: int, k_blocks: int, sms: int) -> int:
    """k-splits so that small-M (decode) GEMMs have about two programs per multiprocessor."""
    return int(max(1, min(k_blocks, triton.cdiv(2 * sms, max(1, grid_mn)), 16)))


def fp8_linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = q_w.shape[0]
    assert q_w.shape[1] == K and q_w.dtype == FP8 and q_w.stride(-1) == 1, (x.shape, q_w.shape, q_w.dtype)
    # Triton's CPU interpreter rounds an e4m3 cast that carries into the next binade wrongly (124.7 -> 64,
    # not 128), so there the activations come from the torch reference; GPUs run the kernel.
    q_a, s_a = quantize_act_ref(x2) if INTERPRET else quantize_act(x2)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    block_n = 64 if M <= 64 else 128
    grid_m, grid_n, nk = triton.cdiv(M, block_m), triton.cdiv(N, block_n), num_blocks(K)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    split = split_k_for(grid_m * grid_n, nk, sms)
    if split > 1:
        out = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        _w8a8_kernel[(grid_m, grid_n, split)](
            q_a, s_a, q_w, s_w, out, bias if bias is not None else out, M, N, K, q_a.stride(0), s_a.stride(0),
            q_w.stride(0), s_w.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK,
            SPLIT_K=split, HAS_BIAS=bias is not None, num_warps=4, num_stages=3)
    if split > 1:
        out = (out + bias.float()) if bias is not None else out
        out = out.to(x.dtype)
    return out.reshape(*shape[:-1], N)
