"""Batch-invariant matmul / linear in Triton: y = x @ w^T (+ b).

Layers: `_bi_matmul_kernel` (the Triton kernel), `bi_matmul` (host launcher: checks, allocation,
grid), `BiLinear` (autograd: forward through the kernel, backward through torch matmuls — gradients
need no invariance), `bi_linear` (functional wrapper used by kernels.ops.linear).

Invariance: one program computes one [BLOCK_M, BLOCK_N] output tile, reducing K from 0 upward in
BLOCK_K steps into an fp32 accumulator, so row m of the output depends only on row m of x, never on M
or on the other rows. No autotuning: the tiling is CONFIGS' (pinned per dtype), or on GPUs with a table
in tilings.py the one it gives for (M, N, K), and only tilings shown to give the pinned bits are there.

Fixed split-K (K_CHUNK, off unless set): K is cut at fixed points, every K_CHUNK columns from 0; each
chunk is reduced as above into a fresh fp32 partial, and the partials are added in ascending order into
a zeroed total. The cut points depend on K alone, so the bits do too; where a chunk is computed is free:
in one program, one chunk after the other (`_tile_acc`, large M), or one program per chunk with the
partials added by `_sum_chunks_kernel` in the same order (small M, where N / BLOCK_N programs leave
most SMs idle). Both give a row the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.matmul_tma import bi_matmul_tma, tma_ready
from lockstep_kernels.gpu.offsets import offset64
from lockstep_kernels.gpu.tile import INTERPRET, sm_count, store_tile
from lockstep_kernels.gpu.tile import capability as gpu_capability
from lockstep_kernels.gpu.tilings import pick

# Pinned tile configurations, by input dtype: the reduction (K from 0 upward in BLOCK_K chunks into one fp32
# accumulator) and the tiling a GPU without a table in tilings.py uses for every M.
CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    torch.float16: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}


# Columns of K per chunk of the fixed split-K, by input dtype (a multiple of BLOCK_K); None: one chunk (the
# reduction as it was, the bits the trainer and engine have agreed on so far). It changes every batch-invariant
# matmul's bits at K > K_CHUNK, in the trainer and the engine alike (one process-wide value: both import it).
# None: on an H100 (2026-12-05) tests/triton_checks.py matmul_split passed (the bits hold) but
# bench/kernels_bench.py --k-chunk showed it slower at M >= 256 (the in-program form holds a second fp32
# accumulator) than it gains at M <= 64, and the 1.7b true on-policy step went 0.91x -> 0.82x (BENCHMARKS.md).
K_CHUNK: dict[torch.dtype, int | None] = {torch.bfloat16: None, torch.float16: None, torch.float32: None}
# Split over programs when the output has fewer tiles than this fraction of the SMs (a pure function of
# M, N, K and the GPU: it moves work between programs, never changes a bit).
SPLIT_BELOW_SM_FRACTION = 0.5


def tiling(m: int, dtype: torch.dtype, capability: tuple[int, int] | None, n: int | None = None,
           k: int | None = None) -> dict:
    """The kernel configuration for an M-row product with an [N, K] weight: CONFIGS[dtype] with the tiling
    tilings.py gives this GPU for that shape and M. A pure function of (M, N, K, dtype, GPU), and a
    row's bits never depend on it (tilings.py says why and how that is shown)."""
    cfg = dict(CONFIGS[dtype])
    row = pick(m, n, k, dtype, capability)
    if row is not None:
        _, bm, bn, bk, warps, stages, *kernel = row
        cfg.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if kernel:
            cfg["kernel"] = kernel[0]
    return cfg


@triton.jit
def _chunk_acc(a_ptr, b_ptr, start_m, start_n, M, N, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
               IEEE: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile of A[:, k_lo:k_hi] @ B[k_lo:k_hi] whose first row is start_m and
    first column start_n: rows from M on read as zero, K reduced from k_lo upward in BLOCK_K chunks by
    one tl.dot each into a zeroed accumulator."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_m = start_m + rows
    offs_n = start_n + cols
    offs_k = tl.arange(0, BLOCK_K)
    # The tile's first row and column in int64 (offsets.py); offsets within the tile and a row (k) stay int32.
    a_ptrs = (a_ptr + offset64(start_m, stride_am)
              + rows[:, None] * stride_am + (k_lo + offs_k)[None, :] * stride_ak)
    b_ptrs = (b_ptr + offset64(start_n, stride_bn)
              + (k_lo + offs_k)[:, None] * stride_bk + cols[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k_left = k_hi - k_lo - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the CPU interpreter's tl.dot is wrong on bf16 inputs
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _tile_acc(a_ptr, b_ptr, start_m, start_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              IEEE: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile of A @ B whose first row is start_m and first column start_n:
    rows from M on read as zero, K reduced from 0 upward in BLOCK_K chunks by one tl.dot each (K_CHUNK 0),
    or each K_CHUNK columns so into a fresh partial, the partials added in ascending order into a zeroed
    total. Every batch-invariant matmul computes its tiles here (this kernel, grouped_matmul.py's) or as
    `_bi_matmul_split_kernel` and `_sum_chunks_kernel` do, so a row's bits are the same whichever does."""
    if K_CHUNK == 0:
        acc = _chunk_acc(a_ptr, b_ptr, start_m, start_n, M, N, 0, K, stride_am, stride_ak, stride_bk, stride_bn,
                         IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(0, tl.cdiv(K, K_CHUNK)):
            k_lo = c * K_CHUNK
            acc += _chunk_acc(a_ptr, b_ptr, start_m, start_n, M, N, k_lo, tl.minimum(k_lo + K_CHUNK, K),
                              stride_am, stride_ak, stride_bk, stride_bn, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def _bi_matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      K_CHUNK: tl.constexpr):
    """C[m, n] = sum_k A[m, k] B[k, n] (+ bias[n]), k ascending in BLOCK_K chunks, fp32 accumulation
    (split at every K_CHUNK columns when K_CHUNK > 0: `_tile_acc`)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    start_m = pid_m * BLOCK_M
    start_n = pid_n * BLOCK_N
    acc = _tile_acc(a_ptr, b_ptr, start_m, start_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                    IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK)
    store_tile(c_ptr, bias_ptr, acc, start_m, start_n, M, N, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _bi_matmul_split_kernel(a_ptr, b_ptr, part_ptr, M, N, K,
                            stride_am, stride_ak, stride_bk, stride_bn, stride_pc, stride_pm,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr):
    """part[c, m, n] = fp32 sum over chunk c's columns of K (c = program_id(1)), reduced as `_tile_acc`
    reduces one chunk."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    start_m = (pid // num_n) * BLOCK_M
    start_n = (pid % num_n) * BLOCK_N
    k_lo = c * K_CHUNK
    part = _chunk_acc(a_ptr, b_ptr, start_m, start_n, M, N, k_lo, tl.minimum(k_lo + K_CHUNK, K),
                      stride_am, stride_ak, stride_bk, stride_bn, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    ptrs = part_ptr + offset64(c, stride_pc) + rows[:, None] * stride_pm + cols[None, :]
    tl.store(ptrs, part, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_chunks_kernel(part_ptr, c_ptr, bias_ptr, M, N, CHUNKS, stride_pc, stride_pm, stride_cm, stride_cn,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """C = sum over c ascending of part[c] into a zeroed fp32 total (+ bias), rounded once: `_tile_acc`'s
    total, from partials other programs computed."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    start_m = (pid // num_n) * BLOCK_M
    start_n = (pid % num_n) * BLOCK_N
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ptrs = part_ptr + rows[:, None] * stride_pm + cols[None, :]
    for _ in range(0, CHUNKS):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += stride_pc  # pointer arithmetic: 64-bit
    store_tile(c_ptr, bias_ptr, acc, start_m, start_n, M, N, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


def k_chunk(dtype: torch.dtype, k: int, block_k: int | None = None) -> int:
    """The split-K chunk for K columns of this dtype: 0 (one chunk) when K_CHUNK is None or K fits in one."""
    chunk = K_CHUNK.get(dtype)
    if chunk is None or k <= chunk:
        return 0
    block_k = block_k or CONFIGS[dtype]["BLOCK_K"]
    assert chunk % block_k == 0, f"K_CHUNK {chunk} must be a multiple of BLOCK_K ({block_k})"
    return chunk


def split_over_programs(tiles: int, sms: int | None) -> bool:
    """Whether a chunked reduction's chunks go to programs of their own (`_bi_matmul_split_kernel`): its
    output tiles fill less than SPLIT_BELOW_SM_FRACTION of the SMs (sms None: the interpreter, by the
    same rule at 132 SMs). Never changes a bit."""
    return tiles < SPLIT_BELOW_SM_FRACTION * (sms or 132)


def bi_matmul(a_MK: torch.Tensor, b_KN: torch.Tensor, bias_N: torch.Tensor | None = None, *,
              cfg: dict | None = None) -> torch.Tensor:
    """a @ b (+ bias) with a's dtype's reduction order and the tiling for M (`tiling`; cfg: this one, as
    the probes and checks of other tilings launch it). Output dtype = a's. A tiling whose row names the
    "tma" kernel runs as matmul_tma.py's persistent kernel where its operands allow (`tma_ready`), else
    here, with the same bits (tilings.py says how that is shown)."""
    assert a_MK.dim() == 2 and b_KN.dim() == 2 and a_MK.shape[1] == b_KN.shape[0], (a_MK.shape, b_KN.shape)
    assert a_MK.dtype == b_KN.dtype, "bi_matmul needs matching input dtypes"
    if a_MK.dtype not in CONFIGS:
        raise TypeError(f"bi_matmul: unsupported dtype {a_MK.dtype}")
    m, k = a_MK.shape
    n = b_KN.shape[1]
    c = torch.empty((m, n), dtype=a_MK.dtype, device=a_MK.device)
    if m == 0 or n == 0:
        return c
    cfg = cfg or tiling(m, a_MK.dtype, gpu_capability(a_MK), n, k)
    chunk = k_chunk(a_MK.dtype, k, cfg["BLOCK_K"])
    if cfg.get("kernel") == "tma" and not chunk and tma_ready(a_MK, b_KN.t(), bias_N):
        return bi_matmul_tma(a_MK, b_KN.t(), bias_N, cfg=cfg)
    cfg = {name: v for name, v in cfg.items() if name != "kernel"}  # operands TMA cannot describe: the same bits here
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    ieee, bias = a_MK.dtype == torch.float32, bias_N if bias_N is not None else c
    if chunk and split_over_programs(tiles, sm_count(a_MK)):
        chunks = triton.cdiv(k, chunk)
        part = torch.empty((chunks, m, n), dtype=torch.float32, device=a_MK.device)
        launch = {name: v for name, v in cfg.items() if name != "GROUP_M"}
        _bi_matmul_split_kernel[(tiles, chunks)](
            a_MK, b_KN, part, m, n, k, a_MK.stride(0), a_MK.stride(1), b_KN.stride(0), b_KN.stride(1),
            part.stride(0), part.stride(1), IEEE=ieee, UPCAST=INTERPRET, K_CHUNK=chunk, **launch)
        _sum_chunks_kernel[(tiles,)](
            part, c, bias, m, n, chunks, part.stride(0), part.stride(1), c.stride(0), c.stride(1),
            HAS_BIAS=bias_N is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=4)
        return c
    _bi_matmul_kernel[(tiles,)](
        a_MK, b_KN, c, bias, m, n, k,
        a_MK.stride(0), a_MK.stride(1), b_KN.stride(0), b_KN.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias_N is not None, IEEE=ieee, UPCAST=INTERPRET, K_CHUNK=chunk, **cfg,
    )
    return c


class BiLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, bias_N):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.has_bias = bias_N is not None
        return bi_matmul(x_MK, w_NK.t(), bias_N)

    @staticmethod
    def backward(ctx, grad_MN):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = grad_MN @ w_NK if ctx.needs_input_grad[0] else None
        grad_w = grad_MN.t() @ x_MK if ctx.needs_input_grad[1] else None
        grad_b = grad_MN.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    out = BiLinear.apply(x.reshape(-1, shape[-1]), weight, bias)
    return out.reshape(*shape[:-1], weight.shape[0])
