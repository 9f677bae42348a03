"""INT4 weights, symmetric, one scale per group of `group_size` input columns (W4A16).

  scale[o, g] = amax(|W[o, g*G:(g+1)*G]|) / 7.5, rounded to the export dtype (so training and the
                served checkpoint use the very same scale)
  q = clamp(round(W / scale), -8, 7)          W ~= q * scale

`fake_quant` is the training side (quantisation-aware training): the forward sees q * scale, the
backward passes the gradient straight through to W (straight-through estimator). `pack` / `unpack`
are the compressed-tensors "pack-quantized" layout that vLLM and SGLang serve: q + 8 as unsigned
nibbles, eight to an int32, element i at bits 4i..4i+3, along the input dimension.
"""

from __future__ import annotations

import torch

QMIN, QMAX = -8, 7
HALF_RANGE = (QMAX - QMIN) / 2  # 7.5


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"INT4 group size {group_size} does not divide the input dimension {inp}")
    return w.reshape(out, inp // group_size, group_size)


def scales(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    amax = _grouped(w.detach().float(), group_size).abs().amax(dim=-1)
    s = (amax / HALF_RANGE).to(scale_dtype).float()
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q int8 [out, in] in [-8, 7], scale fp32 [out, in / group_size])."""
    s = scales(w, group_size, scale_dtype)
    q = torch.clamp(torch.round(_grouped(w.detach().float(), group_size) / s[..., None]), QMIN, QMAX)
    return q.reshape(w.shape).to(torch.int8), s


def dequantize(q: torch.Tensor, s: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (_grouped(q.float(), group_size) * s.float()[..., None]).reshape(q.shape).to(dtype)


def fake_quant(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q * scale in the forward, identity in the backward (STE)."""
    q, s = quantize(w, group_size, scale_dtype)
    return w + (dequantize(q, s, group_size, w.dtype) - w).detach()


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] (in a multiple of 8) -> int32 [out, in / 8]."""
    out, inp = q.shape
    if inp % 8:
        raise ValueError(f"packing INT4 needs the input dimension to be a multiple of 8 (got {inp})")
    u = (q.to(torch.int16) - QMIN).to(torch.uint8)  # 0..15
    byte = u[:, 0::2] | (u[:, 1::2] << 4)  # element 2j in the low nibble, 2j+1 in the high one
    return byte.contiguous().view(torch.int32)  # little-endian: byte k of a word holds elements 2k, 2k+1


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    byte = packed.contiguous().view(torch.uint8)
    lo, hi = (byte & 0xF).to(torch.int8), (byte >> 4).to(torch.int8)
    q = torch.stack((lo, hi), dim=-1).reshape(byte.shape[0], -1)[:, : shape[1]] + QMIN
    return q.reshape(shape)
