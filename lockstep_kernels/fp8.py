"""Blockwise FP8 (e4m3) weight quantisation and FP8 linear layers: 128 x 128 blocks, one fp32 scale per block.

The format and the torch reference are in lockstep_kernels/fp8_ref.py (re-exported here).
`quantize` / `dequantize` / `linear` pick the Triton kernels on GPUs (lockstep_kernels/gpu/fp8.py,
gpu/fp8_matmul.py) and the torch reference elsewhere; quantisation gives the same bits on both.
"""

from __future__ import annotations

import torch

from lockstep_kernels.dispatch import use_triton
from lockstep_kernels.fp8_ref import (BLOCK, E4M3_MAX, FP8, dequantize_ref, error_bound, linear_ref,  # noqa: F401
                                      num_blocks, quantize_act_ref, quantize_ref)


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(w) and w.is_cuda:
        from lockstep_kernels.gpu.fp8 import quantize_blockwise

        return quantize_blockwise(w, block)
    return quantize_ref(w, block)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: int = BLOCK) -> torch.Tensor:
    if use_triton(q) and q.is_cuda:
        from lockstep_kernels.gpu.fp8 import dequantize_blockwise

        return dequantize_blockwise(q, scale_inv, dtype, block)
    return dequantize_ref(q, scale_inv, dtype, block)


def has_fp8_gemm(device: torch.device) -> bool:
    """FP8 tensor cores: NVIDIA compute capability 8.9+ (Ada, Hopper, Blackwell); MI300 (gfx942+) on ROCm."""
    if device.type != "cuda":
        return False
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return "gfx94" in arch or "gfx95" in arch
    return torch.cuda.get_device_capability(device) >= (8, 9)


def linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 GEMM on GPUs that have it (Triton, lockstep_kernels/gpu/fp8_matmul.py); the reference elsewhere."""
    if use_triton(x) and (not x.is_cuda or has_fp8_gemm(x.device)):
        from lockstep_kernels.gpu.fp8_matmul import fp8_linear

        return fp8_linear(x, q_w, s_w, bias)
    return linear_ref(x, q_w, s_w, bias)
