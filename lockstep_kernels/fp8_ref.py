"""Blockwise FP8 (e4m3): the format and its torch reference (CPU and GPU; what the Triton kernels match).

The format of DeepSeek-V3 / SGLang FP8 checkpoints: a linear weight W [out, in] is stored as
`weight` (float8_e4m3fn) and `weight_scale_inv` (fp32, [ceil(out/128), ceil(in/128)]) with
W ~= weight * weight_scale_inv, block by block. scale_inv = amax(|block|) / 448 (e4m3's largest
finite value), so every block uses the full e4m3 range; rounding is to nearest even.

Error bound (the tests check it element by element): e4m3 has 3 mantissa bits, so a value in the
normal range is off by at most 2^-4 of itself, one in the subnormal range by at most half the
subnormal step, 2^-10 x scale_inv.

The Triton kernels (lockstep_kernels/gpu/fp8*.py) import their constants from here, and
lockstep_kernels/fp8.py dispatches between both: no module imports the one that imports it.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def _pad(w: torch.Tensor, block: int) -> torch.Tensor:
    M, N = w.shape
    return torch.nn.functional.pad(w, (0, num_blocks(N, block) * block - N, 0, num_blocks(M, block) * block - M))


def quantize_ref(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [M, N] -> (q float8_e4m3fn [M, N], scale_inv fp32 [ceil(M/b), ceil(N/b)])."""
    if w.dim() != 2:
        raise ValueError(f"blockwise FP8 needs a 2-D weight, got shape {tuple(w.shape)}")
    M, N = w.shape
    x = _pad(w.float(), block)
    bm, bn = x.shape[0] // block, x.shape[1] // block
    blocks = x.view(bm, block, bn, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # Divide by a tensor, not a Python scalar: on CUDA, torch turns `t / scalar` into `t * (1 / scalar)`,
    # which rounds differently from the IEEE division the Triton kernel (and the CPU) does: on the H200
    # 15456 of the 0.5B model's scales differed in the last bit before this (bench/fp8_bench.py).
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(bm * block, bn * block)[:M, :N].contiguous(), scale_inv


def dequantize_ref(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: int = BLOCK) -> torch.Tensor:
    M, N = q.shape
    s = scale_inv.repeat_interleave(block, 0)[:M].repeat_interleave(block, 1)[:, :N]
    return (q.float() * s).to(dtype)


def error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Largest |dequantize(quantize(w)) - w| allowed per element (see the module docstring)."""
    M, N = w.shape
    s = scale_inv.repeat_interleave(block, 0)[:M].repeat_interleave(block, 1)[:, :N]
    return torch.maximum(w.float().abs() * 2.0 ** -4, s * 2.0 ** -10)


# ---- FP8 linear layers (W8A8, DeepSeek-V3 / SGLang block scaling) ----------------------------------
# The weight keeps its 128 x 128 blocks; activations are quantised per token and 128-channel group at
# run time (scale = amax / 448 of the group), and y = sum over k-blocks of (a_q . w_q) * a_scale *
# w_scale, accumulated in fp32. The torch reference computes the same sum from the dequantised
# operands (the products of e4m3 values are exact in fp32; only the order of the fp32 sums differs).


def quantize_act_ref(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/b)]): one scale per token and group."""
    M, K = x.shape
    kb = num_blocks(K, block)
    g = torch.nn.functional.pad(x.float(), (0, kb * block - K)).view(M, kb, block)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(M, kb * block)[:, :K].contiguous(), scale


def linear_ref(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None = None,
               block: int = BLOCK) -> torch.Tensor:
    """y = x W^T (+ bias) with W in blockwise FP8 and x quantised per token group; output in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q_a, s_a = quantize_act_ref(x2, block)
    a = q_a.float() * s_a.repeat_interleave(block, 1)[:, : x2.shape[1]]
    y = a @ dequantize_ref(q_w, s_w, torch.float32, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], q_w.shape[0])
