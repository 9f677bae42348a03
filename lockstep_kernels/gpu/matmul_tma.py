"""The batch-invariant matmul as a persistent kernel with TMA loads (Hopper and later), y = x @ w^T (+ b).

Layers: `_bi_matmul_tma_kernel` (the Triton kernel), `tma_ready` (whether operands can be described),
`bi_matmul_tma` (host launcher: checks, the tensor descriptors, grid). matmul.bi_matmul launches it for
the tilings.py rows that name it: `bench/bi_tile_probe.py` runs it beside matmul.py's kernel at every
probed shape and M, bitwise and timed, and a row names it only where that showed the same bits and
more speed.

Why it may keep the bits: a tile is reduced exactly as matmul.py's `_chunk_acc` reduces it (one tl.dot
per BLOCK_K chunk of K from 0 upward into one fp32 accumulator; what lies past M, N or K reads as zero,
here from the TMA unit's out-of-bounds fill instead of masked loads), rounded once by the same epilogue
(`store_tile`). What changes is who loads the operands (the TMA unit, asynchronously, into shared
memory) and that one program per SM walks the tiles (tile t, t + SMs, ...), so the next tile's loads
overlap this tile's epilogue. Whether the MMA sequence, and so every bit, is the same is measured.

Needs x [M, K] and w [N, K] with unit stride along K and 16-byte-aligned rows (K * 2 bytes a multiple
of 16 for bf16): what the engine and trainer's linear layers hold.
Legend: M rows, K in-features, N out-features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.tile import INTERPRET, sm_count, store_tile


@triton.jit
def _bi_matmul_tma_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn,
                          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    """C[m, n] = sum_k A[m, k] W[n, k] (+ bias[n]), k ascending in BLOCK_K chunks, fp32 accumulation;
    program p computes output tiles p, p + NUM_SMS, ... in matmul.py's grouped tile order."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    for tile in range(tl.program_id(0), num_m * num_n, NUM_SMS):
        first_m = (tile // group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        start_m = (first_m + (tile % group) % size_m) * BLOCK_M
        start_n = ((tile % group) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([start_m, k * BLOCK_K])
            b = b_desc.load([start_n, k * BLOCK_K])
            if UPCAST:  # the CPU interpreter's tl.dot is wrong on bf16 inputs
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        store_tile(c_ptr, bias_ptr, acc, start_m, start_n, M, N, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


def tma_ready(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> bool:
    """Whether TMA descriptors can describe x and w: bf16/fp16 on a GPU, unit stride along K, rows and base
    addresses 16-byte aligned (what the engine's and trainer's linear layers hold; a sliced or transposed
    view may not be)."""
    def ok(t: torch.Tensor) -> bool:
        size = t.element_size()
        return t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0
    return (x_MK.is_cuda and x_MK.dtype == w_NK.dtype and x_MK.dtype in (torch.bfloat16, torch.float16)
            and ok(x_MK) and ok(w_NK) and (bias_N is None or bias_N.is_contiguous()))


def bi_matmul_tma(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None, *, cfg: dict,
                  num_sms: int | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) in x's dtype with tiling `cfg` (matmul.CONFIGS' keys). num_sms: programs
    (default: the GPU's SMs; the CPU interpreter: 4)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    assert x_MK.dim() == 2 and w_NK.dim() == 2 and x_MK.shape[1] == w_NK.shape[1], (x_MK.shape, w_NK.shape)
    assert x_MK.dtype == w_NK.dtype and x_MK.dtype in (torch.bfloat16, torch.float16), x_MK.dtype
    assert x_MK.stride(1) == 1 and w_NK.stride(1) == 1, "K must have unit stride for the TMA descriptors"
    m, k = x_MK.shape
    n = w_NK.shape[0]
    c = torch.empty((m, n), dtype=x_MK.dtype, device=x_MK.device)
    if m == 0 or n == 0:
        return c
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(x_MK, block_shape=[bm, bk])
    b_desc = TensorDescriptor.from_tensor(w_NK, block_shape=[bn, bk])
    num_sms = num_sms or sm_count(x_MK) or 4
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # NUM_SMS (a compile-time constant: the tile stride) is the GPU's SM count whatever M is; with fewer
    # tiles than SMs, fewer programs start and each takes one tile. Passing min(SMs, tiles) there instead
    # compiled the kernel anew for every M whose tile count is below the SM count (each new prefill or
    # micro-batch length: seconds of compiles inside a run, none of them in a probe at fixed M).
    _bi_matmul_tma_kernel[(min(num_sms, tiles),)](
        a_desc, b_desc, c, bias_N if bias_N is not None else c, m, n, k, c.stride(0), c.stride(1),
        HAS_BIAS=bias_N is not None, UPCAST=INTERPRET, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8),
        NUM_SMS=num_sms, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return c
