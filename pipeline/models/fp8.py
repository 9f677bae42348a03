"""FP8 linear layers for rollout (engine.quantization=fp8): which weights, and how they are held.

The targets are the attention and MLP / expert projections (`is_fp8_target`; embeddings, norms, the
MoE router and the LM head stay in the model dtype, as in DeepSeek-V3 / SGLang FP8 checkpoints). A
target Linear holds `weight` as float8_e4m3fn and `weight_scale_inv` (fp32, one per 128 x 128 block),
the checkpoint's own names, and its forward is kernels.fp8.linear (W8A8 with per-token-group
activation scales). The weight sync sends exactly these pairs (weights.quantization=fp8), which the
engine stores without a round trip through bf16; a full-precision update is quantised on arrival.
"""

from __future__ import annotations

import re

import torch

from lockstep_kernels import fp8
from pipeline.models.flat import copy_tensors

SCALE_SUFFIX = "_scale_inv"
_LINEAR = re.compile(r"\.layers\.\d+\..*_proj\.weight$")  # attention and MLP/expert projections


def is_fp8_target(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and bool(_LINEAR.search(name)) and t.is_floating_point()


@torch.no_grad()
def to_fp8(model: torch.nn.Module) -> int:
    """Quantise every target Linear of `model` in place (blockwise FP8). Returns how many."""
    from pipeline.models.qwen3 import Linear

    n = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and is_fp8_target(name + ".weight", module.weight) \
                and module.weight.dtype != fp8.FP8:
            q, s = fp8.quantize(module.weight.detach())
            module.weight = torch.nn.Parameter(q, requires_grad=False)
            module.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
            module.fp8 = True
            n += 1
    return n


@torch.no_grad()
def load_into(params: dict[str, torch.Tensor], named: dict[str, torch.Tensor]) -> set[str]:
    """Copy `named` into the model's parameters: FP8 pairs as they are, a full-precision tensor for an
    FP8 weight quantised first, anything else cast to the parameter's dtype. Returns the parameter
    names now written (a quantised weight writes its scale too)."""
    written = set()
    dst, src = [], []  # same-dtype copies: spans and one multi-tensor copy (a version is ~300 tensors)
    for name, t in named.items():
        p = params[name]
        if p.dtype == fp8.FP8 and t.dtype != fp8.FP8:
            q, s = fp8.quantize(t.to(p.device))
            p.copy_(q)
            params[name + SCALE_SUFFIX].copy_(s)
            written.add(name + SCALE_SUFFIX)
        elif t.dtype == fp8.FP8 and p.dtype != fp8.FP8:
            raise ValueError(f"{name} arrived as FP8 but this engine holds it as {p.dtype}")
        elif t.dtype == p.dtype and t.device == p.device and t.shape == p.shape:
            dst.append(p)
            src.append(t)
        else:
            p.copy_(t.to(p.dtype))
        written.add(name)
    if dst:
        copy_tensors(dst, src)
    return written
