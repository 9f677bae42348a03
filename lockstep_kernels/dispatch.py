"""Backend choice for batch-invariant ops: Triton on CUDA and ROCm GPUs, the torch path elsewhere.

aiter (AMD's kernel library) has fast RMSNorm, GEMM and attention, but none of its kernels promise a
row result independent of batch size (they pick tiles and split-K by shape), so on ROCm the Triton
kernels run through Triton's AMD backend. `LOCKSTEP_BI_BACKEND=torch` forces the torch path (tests).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    if os.environ.get("LOCKSTEP_BI_BACKEND") == "torch":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return triton_available()  # CPU tensors through the interpreter (kernel tests)
    return x.is_cuda and triton_available()


def is_rocm() -> bool:
    return torch.version.hip is not None
