"""Backend choice for the kernel library's ops: Triton on CUDA and ROCm GPUs, the torch path elsewhere.

aiter (AMD's kernel library) has fast RMSNorm, GEMM and attention, but none of its kernels promise a
row result independent of batch size (they pick tiles and split-K by shape), so on ROCm the Triton
kernels run through Triton's AMD backend.

`set_backend("torch")` makes every op take its torch path on GPUs too (the process default; the run
config's determinism.kernel_backend sets it in engines and trainers alike). `TRITON_INTERPRET=1`
(Triton's own variable) runs the Triton kernels on CPU tensors through its interpreter (kernel tests).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch")
_backend = "auto"


def set_backend(name: str) -> None:
    """auto: Triton kernels on GPUs, torch paths on CPUs; torch: torch paths everywhere."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: use one of {', '.join(BACKENDS)}")
    _backend = name


def backend() -> str:
    return _backend


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return triton_available()  # CPU tensors through the interpreter (kernel tests)
    return x.is_cuda and triton_available()


def is_rocm() -> bool:
    return torch.version.hip is not None
