"""Rotary position embeddings: the frequency table of each RoPE type and its cos/sin.

`inv_freq` computes what transformers' `modeling_rope_utils` computes for default, linear, dynamic,
yarn and llama3 RoPE, with the same expressions in the same order, so the table (and YaRN's attention
factor, which scales cos and sin) is bit-identical to transformers' on the same device. Dynamic NTK is
the table transformers holds while every sequence fits max_position_embeddings; past that it would
depend on each batch's longest sequence, so longer runs are refused at start
(ModelArgs.check_context_length). The table is recomputed on the positions' device in every forward
(a few small ops, captured by the engine's CUDA graphs): trainer, engine, MTP head and megatron's
rotary embedding all read this one function.

MLA (DeepSeek-V3) rotates only its qk_rope_head_dim part (`ModelArgs.rope_dim`), on interleaved pairs
when rope_interleave (`apply_rope_interleaved`), and its softmax scale carries YaRN's mscale_all_dim
(`mla_softmax_scale`), as transformers' DeepseekV3Attention.

Legend: N tokens, Hd head dim (the rotated dims), F = Hd / 2 frequencies.
"""

from __future__ import annotations

import math

import torch

from pipeline.models.config import ModelArgs


# Every tensor is created on `device` itself: the engine captures the forward in CUDA graphs, where a
# host-to-device copy is not allowed. (transformers builds some aranges as int64 and converts them;
# small integers are exact in fp32, so the values are the same.)
def _default(theta: float, dim: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


def inv_freq(args: ModelArgs, device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [F] in fp32, attention factor multiplying cos and sin)."""
    dim, base, rs = args.rope_dim, args.rope_theta, args.rope_scaling
    if rs is None:
        return _default(base, dim, device), 1.0
    factor = rs.get("factor")
    if rs.rope_type == "linear":
        freq = _default(base, dim, device)
        freq /= factor
        return freq, 1.0
    if rs.rope_type == "dynamic":  # transformers' table for sequences within max_position_embeddings
        seq_len = max_len = args.max_position_embeddings
        base = base * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
        return _default(base, dim, device), 1.0
    if rs.rope_type == "llama3":
        return _llama3(_default(base, dim, device), rs), 1.0
    if rs.rope_type == "yarn":
        return _yarn(base, dim, rs, device)
    raise AssertionError(f"rope_type {rs.rope_type!r} passed the config reader")


def _llama3(freq: torch.Tensor, rs) -> torch.Tensor:
    factor, low, high = rs.get("factor"), rs.get("low_freq_factor"), rs.get("high_freq_factor")
    old_len = rs.get("original_max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)  # long wavelengths: divided by factor
    smooth = (old_len / wavelen - low) / (high - low)  # in between: interpolated
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _get_mscale(scale, m=1) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_softmax_scale(args: ModelArgs) -> float:
    """MLA's attention scale: 1/sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under a RoPE
    scaling with mscale_all_dim (transformers' yarn_apply_mscale, same expression order)."""
    scale = args.head_dim ** (-0.5)
    rs = args.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        mscale = _get_mscale(rs.get("factor"), rs.get("mscale_all_dim"))
        scale = scale * mscale * mscale
    return scale


def yarn_attention_factor(rs) -> float:
    """YaRN's cos/sin scale: attention_factor if given, else 0.1 ln(factor) + 1 (with mscale /
    mscale_all_dim: their ratio), as transformers' _compute_yarn_parameters."""
    if rs.get("attention_factor") is not None:
        return rs.get("attention_factor")
    factor, mscale, mscale_all_dim = rs.get("factor"), rs.get("mscale"), rs.get("mscale_all_dim")

    if mscale and mscale_all_dim:
        return float(_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim))
    return _get_mscale(factor)


def _yarn(base: float, dim: int, rs, device) -> tuple[torch.Tensor, float]:
    factor, old_len = rs.get("factor"), rs.get("original_max_position_embeddings")
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension that turns `rotations` times over the original length
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return freq, yarn_attention_factor(rs)


def rope_cos_sin(positions_N: torch.Tensor, args: ModelArgs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, Hd] for the given absolute positions (computed in fp32, like transformers)."""
    freq_F, scale = inv_freq(args, positions_N.device)
    freqs = positions_N[:, None].float() * freq_F[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    half = x_NHD.shape[-1] // 2
    rotated = torch.cat((-x_NHD[..., half:], x_NHD[..., :half]), dim=-1)
    return x_NHD * cos_ND[:, None] + rotated * sin_ND[:, None]


def apply_rope_interleaved(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the result is laid out [rotated evens, rotated
    odds] (as transformers' apply_rotary_pos_emb_interleave: q and k alike, so q.k is unchanged). Same
    products and sums as apply_rope on the de-interleaved input."""
    return apply_rope(torch.cat((x_NHD[..., 0::2], x_NHD[..., 1::2]), dim=-1), cos_ND, sin_ND)
