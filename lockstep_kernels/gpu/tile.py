"""What every batch-invariant matmul kernel here shares: the epilogue that stores a tile, the GPU facts
the launchers read (compute capability, SMs), and whether Triton runs on the CPU interpreter.

matmul.py (one program per tile), matmul_tma.py (persistent, TMA loads) and grouped_matmul.py (MoE
experts) round and store a tile through the same `store_tile`, so a row's bits are the same whichever
of them computed it, given the same fp32 accumulator.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.offsets import offset64

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of t's GPU (None off GPUs)."""
    return _device_capability(_index(t)) if t.is_cuda else None


def sm_count(t: torch.Tensor) -> int | None:
    """The SMs of t's GPU (None off GPUs)."""
    return _sm_count(_index(t)) if t.is_cuda else None


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def store_tile(c_ptr, bias_ptr, acc, start_m, start_n, M, N, stride_cm, stride_cn,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc (+ bias) rounded once to C's dtype, rows < M and columns < N."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_m = start_m + rows
    offs_n = start_n + cols
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    c_ptrs = (c_ptr + offset64(start_m, stride_cm) + offset64(start_n, stride_cn)
              + rows[:, None] * stride_cm + cols[None, :] * stride_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
