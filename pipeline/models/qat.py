"""Quantisation-aware training: which weights train through a fake quantiser, and what is sent/exported.

INT4 QAT (train.int4_qat) targets the MoE experts' projections, the bulk of a MoE model's bytes: their
forward uses kernels.int4.fake_quant(W), so the policy learns weights that survive 4-bit rounding,
and what the engines receive (weight sync) and serve (the exported W4A16 checkpoint) is exactly the
q * scale the trainer computed with.
"""

from __future__ import annotations

import functools
import re

import torch

from lockstep_kernels import int4

EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def is_int4_target(name: str) -> bool:
    return bool(EXPERT.search(name))


def enable_int4_qat(model: torch.nn.Module, group_size: int, scale_dtype: torch.dtype) -> int:
    """Route every expert projection's forward through the INT4 fake quantiser. Returns how many."""
    from pipeline.models.layers import Linear

    n = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and is_int4_target(name + ".weight"):
            if module.in_features % group_size:
                raise ValueError(f"train.int4_group_size {group_size} does not divide {name}'s input size"
                                 f" {module.in_features}")
            module.weight_transform = functools.partial(int4.fake_quant, group_size=group_size, scale_dtype=scale_dtype)
            n += 1
    return n


def int4_values(named, group_size: int, scale_dtype: torch.dtype):
    """The weight stream with expert projections replaced by their INT4 values (q * scale), for a sync."""
    for name, t in named:
        yield name, (int4.fake_quant(t, group_size, scale_dtype).to(t.dtype) if is_int4_target(name) else t)


def w4a16_state(state: dict[str, torch.Tensor], group_size: int, scale_dtype: torch.dtype
                ) -> tuple[dict[str, torch.Tensor], dict]:
    """Export layout (compressed-tensors pack-quantized): expert projections as weight_packed (int32),
    weight_scale (scale_dtype) and weight_shape; everything else as it is. Returns (state, the
    quantization_config for config.json)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not is_int4_target(name):
            out[name] = t
            continue
        q, s = int4.quantize(t, group_size, scale_dtype)
        prefix = name.removesuffix(".weight")
        out[prefix + ".weight_packed"] = int4.pack(q)
        out[prefix + ".weight_scale"] = s.to(scale_dtype)
        out[prefix + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
    config = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["re:.*experts.*_proj$"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False},
            "input_activations": None}},
        "ignore": ["lm_head"],
    }
    return out, config


def dense_from_w4a16(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Loading a W4A16 checkpoint into a dense model (the built-in engine, tests): q * scale."""
    out = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            shape = tuple(int(x) for x in state[prefix + ".weight_shape"].tolist())
            scale = state[prefix + ".weight_scale"]
            group_size = shape[1] // scale.shape[1]
            out[prefix + ".weight"] = int4.dequantize(int4.unpack(t, shape), scale, group_size, dtype)
        else:
            out[name] = t
    return out
