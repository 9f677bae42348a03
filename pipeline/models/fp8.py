"""FP8 linear layers for rollout (engine.quantization=fp8): which weights, and how they are held.

The targets are the attention and MLP / expert projections (`is_fp8_target`: `*_proj` and MLA's
`kv_a_proj_with_mqa`; embeddings, norms, the MoE router and the LM head stay in the model dtype, as in
DeepSeek-V3 / SGLang FP8 checkpoints). A
target Linear holds `weight` as float8_e4m3fn and `weight_scale_inv` (fp32, one per 128 x 128 block),
the checkpoint's own names, and its forward is kernels.fp8.linear (W8A8 with per-token-group
activation scales). The weight sync sends exactly these pairs (weights.quantization=fp8), which the
engine stores without a round trip through bf16; a full-precision update is quantised on arrival.

Checkpoints in that layout (DeepSeek-V3's published FP8 weights, quantization_config quant_method fp8):
`checkpoint_pairs` finds their (weight, weight_scale_inv) pairs, `keep_pairs` puts them unchanged into an
FP8 model (engine.quantization=fp8: the checkpoint's own bits, no round trip), and `block_fp8_state`
writes a state dict in the same layout (checkpoint.export_quantization=fp8).
"""

from __future__ import annotations

import re

import torch

from lockstep_kernels import fp8
from pipeline.models.flat import copy_tensors

SCALE_SUFFIX = "_scale_inv"
_LINEAR = re.compile(r"\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")  # attention and MLP/expert projections


def is_fp8_target(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and bool(_LINEAR.search(name)) and t.is_floating_point()


@torch.no_grad()
def to_fp8(model: torch.nn.Module) -> int:
    """Quantise every target Linear of `model` in place (blockwise FP8). Returns how many."""
    from pipeline.models.layers import Linear

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


def checkpoint_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{weight name: (e4m3 weight, its weight_scale_inv)} of a state dict read from a checkpoint."""
    return {n: (t, state[n + SCALE_SUFFIX]) for n, t in state.items() if t.dtype == fp8.FP8 and n + SCALE_SUFFIX in state}


@torch.no_grad()
def keep_pairs(model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy checkpoint FP8 pairs into the FP8 layers (after to_fp8) of the same names. Returns how many."""
    params = dict(model.named_parameters())
    n = 0
    for name, (q, s) in pairs.items():
        if name in params and params[name].dtype == fp8.FP8:
            params[name].copy_(q)
            params[name + SCALE_SUFFIX].copy_(s)
            n += 1
    return n


def block_fp8_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in the blockwise FP8 checkpoint layout: every target weight as e4m3 + weight_scale_inv."""
    out = {}
    for name, t in state.items():
        if is_fp8_target(name, t) and t.dtype != fp8.FP8:
            out[name], out[name + SCALE_SUFFIX] = fp8.quantize(t)
        else:
            out[name] = t
    return out
