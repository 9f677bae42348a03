"""Grouped (per-expert) matmul in Triton: rows grouped by expert, every expert in one launch.

    out[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ w[e]^T        for every expert e

Layers: `_grouped_matmul_kernel` (the Triton kernel), `bi_grouped_linear` (host launcher: checks,
allocation, grid; kernels.ops.grouped_linear calls it). No autograd: the engine calls it under inference mode; training keeps the per-expert
loop (pipeline/models/layers.py run_experts), which autograd, FSDP and the unused-expert trick need.

Bits: an expert's rows are computed exactly as `bi_matmul(x_rows_of_e, w[e].t())` computes them
(matmul.py): CONFIGS' tiling, whatever tilings.py gives bi_matmul for an expert's row count
(a table row holds only tilings bench/bi_tile_probe.py showed to give CONFIGS' bits at the experts'
shapes too), the same [BLOCK_M, BLOCK_N] tiles starting at the expert's first
row, computed and stored by matmul.py's own tile routines (`_tile_acc`, tile.py's `store_tile`: rows past the expert's last read as zero, K
reduced from 0 upward in BLOCK_K steps into an fp32 accumulator, split at matmul.K_CHUNK as bi_matmul splits it), the same IEEE / UPCAST flags. The true on-policy trainer computes
experts with that per-expert call, and the engine's logprobs must equal the trainer's bit for bit.

No host sync: the expert offsets stay on the device. The grid is fixed by the number of rows A and
experts E alone, an upper bound on the tiles, min(cdiv(A, BLOCK_M) + E, A) per column block; each
program finds its expert from the offsets (a cumulative sum of the experts' tile counts) and programs
past the real tile count exit. So a decode step of fixed batch size launches the same grid every time
(CUDA-graph capturable).

Legend: A rows (expert assignments, grouped by expert), K in-features, N out-features, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.matmul import CONFIGS, _tile_acc, k_chunk
from lockstep_kernels.gpu.offsets import offset64
from lockstep_kernels.gpu.tile import INTERPRET, store_tile


@triton.jit
def _grouped_matmul_kernel(a_ptr, b_ptr, c_ptr, offsets_ptr, N, K, E,
                           stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           K_CHUNK: tl.constexpr):
    """C[m, n] = sum_k A[m, k] B[e, n, k] for rows m of expert e (offsets[e] <= m < offsets[e+1]),
    k ascending in BLOCK_K chunks, fp32 accumulation; the tiles of expert e start at offsets[e]."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = pid // num_n
    pid_n = pid % num_n
    # Which expert's tile: experts' tile counts, their inclusive cumulative sum, the first past `tile`.
    experts = tl.arange(0, BLOCK_E)
    lo_E = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    hi_E = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    tiles_E = (hi_E - lo_E + BLOCK_M - 1) // BLOCK_M
    ends_E = tl.cumsum(tiles_E, 0)
    e = tl.sum((ends_E <= tile).to(tl.int32), 0)
    if e >= E:  # past the real tiles (the grid is an upper bound)
        return
    mine = experts == e
    first_tile = tl.sum(tl.where(mine, ends_E - tiles_E, 0), 0)
    row_end = tl.sum(tl.where(mine, hi_E, 0), 0)
    start_m = tl.sum(tl.where(mine, lo_E, 0), 0) + (tile - first_tile) * BLOCK_M
    # matmul.py's tile (the same code), with the expert's weight and the expert's last row as M.
    start_n = pid_n * BLOCK_N
    acc = _tile_acc(a_ptr, b_ptr + offset64(e, stride_be), start_m, start_n, row_end, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK)
    store_tile(c_ptr, c_ptr, acc, start_m, start_n, row_end, N, stride_cm, stride_cn, False, BLOCK_M, BLOCK_N)


def max_tiles(rows: int, experts: int, block_m: int) -> int:
    """An upper bound on the row tiles of `rows` rows grouped into `experts` groups (each group's tiles
    start at its first row): cdiv(rows, block_m) + experts, and at most one tile per row."""
    return min(triton.cdiv(rows, block_m) + experts, rows)


def bi_grouped_linear(x_AK: torch.Tensor, w_ENK: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """out [A, N]: rows offsets[e]:offsets[e+1] of x times w[e]^T, each expert's rows bitwise as
    bi_matmul(those rows, w[e].t()) computes them. offsets_E1 (int32, on x's device, offsets[0] = 0,
    offsets[E] = A) is never read by the host."""
    assert x_AK.dim() == 2 and w_ENK.dim() == 3 and x_AK.shape[1] == w_ENK.shape[2], (x_AK.shape, w_ENK.shape)
    assert x_AK.dtype == w_ENK.dtype, "bi_grouped_linear needs matching input dtypes"
    e, n, k = w_ENK.shape
    assert offsets_E1.shape == (e + 1,) and offsets_E1.dtype == torch.int32, (offsets_E1.shape, offsets_E1.dtype)
    if x_AK.dtype not in CONFIGS:
        raise TypeError(f"bi_grouped_linear: unsupported dtype {x_AK.dtype}")
    a = x_AK.shape[0]
    c = torch.empty((a, n), dtype=x_AK.dtype, device=x_AK.device)
    if a == 0 or n == 0:
        return c
    cfg = {name: v for name, v in CONFIGS[x_AK.dtype].items() if name != "GROUP_M"}
    grid = (max_tiles(a, e, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_matmul_kernel[grid](
        x_AK, w_ENK, c, offsets_E1, n, k, e,
        x_AK.stride(0), x_AK.stride(1), w_ENK.stride(0), w_ENK.stride(1), w_ENK.stride(2), c.stride(0), c.stride(1),
        IEEE=x_AK.dtype == torch.float32, UPCAST=INTERPRET, BLOCK_E=triton.next_power_of_2(e),
        K_CHUNK=k_chunk(x_AK.dtype, k), **cfg,
    )
    return c
