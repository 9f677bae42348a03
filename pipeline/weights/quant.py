"""Low-precision weight updates: the trainer's weights as blockwise FP8 for FP8 rollout engines.

`fp8_stream` turns the stream of (name, tensor) a weight sync sends into SGLang's FP8 checkpoint
layout: every linear weight inside a decoder layer becomes `...weight` (float8_e4m3fn) plus
`...weight_scale_inv` (fp32, one per 128 x 128 block); embeddings, lm_head, norms and MoE routers stay
in the training dtype (as in FP8 checkpoints). A linear weight then costs 1 byte per element plus 4
bytes per 16384: half of bf16. `dequantize_fp8_pairs` is the engine side for engines that compute in
bf16/fp32 (a built-in engine without engine.quantization=fp8): W = q * scale_inv, the values an FP8
engine computes with; a built-in FP8 engine keeps the pairs (pipeline/models/fp8.py).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from lockstep_kernels import fp8

from pipeline.models.fp8 import SCALE_SUFFIX, is_fp8_target  # noqa: F401  (re-exported: senders use them)


def fp8_stream(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in named:
        if is_fp8_target(name, t):
            q, s = fp8.quantize(t)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def dequantize_fp8_pairs(staged: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Replace each (weight, weight_scale_inv) pair by the dequantized weight in the engine's dtype."""
    out = {}
    for name, t in staged.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = staged.get(name + SCALE_SUFFIX)
        if t.dtype == fp8.FP8:
            if scale is None:
                raise ValueError(f"{name} arrived as FP8 without {name + SCALE_SUFFIX}")
            t = fp8.dequantize(t, scale, dtypes.get(name, torch.float32))
        out[name] = t
    return out


def wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the collective sends it: FP8 travels as its bytes (gloo has no FP8 type)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
