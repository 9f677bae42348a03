"""Multi-head Latent Attention (DeepSeek-V2 / V3), shared by the trainer and the built-in engine.

Per token, with H heads of qk dim nope + rope and value dim Dv:
  q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is None)  [H, nope + rope]
  latent = kv_a_layernorm(c), k_rope = RoPE(r)    where [c | r] = kv_a_proj_with_mqa(x)      [C], [R]
  k_h    = [kv_b_proj(latent)_h,nope | k_rope]    v_h = kv_b_proj(latent)_h,v                (one k_rope for all heads)
  out    = o_proj(softmax(q_h k_h^T * scale) v_h) scale = 1/sqrt(nope + rope) x YaRN mscale^2 (rope.mla_softmax_scale)
The RoPE part of q and k is rotated on interleaved pairs when rope_interleave (DeepSeek's layout).

What the engine's KV cache holds per token and layer is the latent row [latent | k_rope] (C + R values:
576 for DeepSeek-V3, against 2 x 128 x 192 for full keys and values). The module hands it to the
attention context (`ctx.attend_latent`), which says where it comes from: a packed training batch
(pipeline/models/attention.py) or the engine's latent cache (pipeline/rollout/engine/kv_cache.py). The
contexts then attend over latent rows in one of two ways:
  - expanded (`attend_expanded`): kv_b_proj turns each latent row into every head's key and value and
    attention runs at qk dim nope + rope, v dim Dv. Training, engine prefill and, in batch-invariant
    mode (true on-policy), every engine step: a row's expansion is the same per-row matmul in the
    trainer and the engine, so their logprobs agree bit for bit.
  - absorbed (`attend_absorbed`): kv_b_proj's key half folds into the query (q_nope W_UK: a C-dim
    query per head) and its value half is applied after attention, so attention reads the latent rows
    directly as one shared key head of C + R dims and value of C dims (MQA), without expanding the
    cache. Engine decode steps in default mode only: it sums the same products in another order, so
    its logits differ from the expanded ones in the last bits and it is never used in batch-invariant mode.

Legend: N stream tokens, B sequences, H heads, Q queries per sequence, T cached positions, C kv_lora_rank,
R qk_rope_head_dim, L = C + R latent row, D = nope + R qk head dim, V v head dim.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep_kernels as kernels

from pipeline.models.config import ModelArgs
from pipeline.models.layers import Linear, RMSNorm
from pipeline.models.rope import apply_rope, apply_rope_interleaved, mla_softmax_scale

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers (and DeepSeek's code) build them with the default eps


class MLAttention(nn.Module):
    """MLA with transformers' DeepseekV3Attention parameter names (q_proj or q_a_proj / q_a_layernorm /
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    absorb_decode = True  # default-mode decode steps through the absorbed form (tests switch it off to compare)

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, H = args.hidden_size, args.num_attention_heads
        self.n_heads, self.nope, self.rope, self.v_dim = H, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rank, self.qk_dim = args.kv_lora_rank, args.qk_nope_head_dim + args.qk_rope_head_dim
        if args.q_lora_rank:
            self.q_a_proj = Linear(h, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(args.q_lora_rank, H * self.qk_dim, bias=False)
        else:
            self.q_proj = Linear(h, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, h, bias=args.attention_bias)
        self.q_lora = bool(args.q_lora_rank)
        self.scale = mla_softmax_scale(args)
        self.rotate = apply_rope_interleaved if args.rope_interleave else apply_rope

    def forward(self, x_ND, cos, sin, ctx, layer_idx: int):
        n = x_ND.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_ND))) if self.q_lora else self.q_proj(x_ND)
        q_nope, q_rope = q.view(n, self.n_heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        c_NC, r_NR = self.kv_a_proj_with_mqa(x_ND).split([self.rank, self.rope], dim=-1)
        q_NHD = torch.cat((q_nope, self.rotate(q_rope, cos, sin)), dim=-1)
        latent_NL = torch.cat((self.kv_a_layernorm(c_NC), self.rotate(r_NR[:, None], cos, sin)[:, 0]), dim=-1)
        o_NHV = ctx.attend_latent(layer_idx, q_NHD, latent_NL, self)
        return self.o_proj(o_NHV.reshape(n, self.n_heads * self.v_dim))

    # ---- attention over latent rows (called by the attention contexts) ---------------------------
    def expand(self, latent_XL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's key [..., H, D] and value [..., H, V] from latent rows [..., L]."""
        lead = latent_XL.shape[:-1]
        kv = self.kv_b_proj(latent_XL[..., : self.rank]).view(*lead, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = latent_XL[..., None, self.rank:].expand(*lead, self.n_heads, self.rope)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def attend_expanded(self, q_BHQD, latent_BTL, qpos_BQ) -> torch.Tensor:
        """[B, H, Q, V]: query (b, i) over latent rows 0..qpos[b, i] of sequence b, keys and values expanded."""
        k_BTHD, v_BTHV = self.expand(latent_BTL)
        return kernels.attention(q_BHQD, k_BTHD.transpose(1, 2), v_BTHV.transpose(1, 2), qpos_BQ, self.scale)

    def attend_absorbed(self, q_BHQD, latent_BTL, qpos_BQ) -> torch.Tensor:
        """The same attention with kv_b_proj folded into the query and the output (MQA over latent rows)."""
        w_HXC = self.kv_b_weight().view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_HXC[:, : self.nope], w_HXC[:, self.nope:]
        q_lat = torch.einsum("bhqn,hnc->bhqc", q_BHQD[..., : self.nope], w_uk.to(q_BHQD.dtype))
        q_full = torch.cat((q_lat, q_BHQD[..., self.nope:]), dim=-1)
        lat = latent_BTL[:, None]  # one key / value head
        o_lat = kernels.attention(q_full, lat, lat[..., : self.rank], qpos_BQ, self.scale)
        return torch.einsum("bhqc,hvc->bhqv", o_lat, w_uv.to(o_lat.dtype))

    def attend_cached(self, q_BHQD, latent_BTL, qpos_BQ, decode: bool) -> torch.Tensor:
        """The engine's choice: absorbed for decode steps in default mode, expanded otherwise."""
        if decode and self.absorb_decode and not kernels.is_batch_invariant():
            return self.attend_absorbed(q_BHQD, latent_BTL, qpos_BQ)
        return self.attend_expanded(q_BHQD, latent_BTL, qpos_BQ)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H x (nope + V), C] in full precision (dequantised when the engine holds it in FP8)."""
        w = self.kv_b_proj.weight
        if self.kv_b_proj.fp8:
            from lockstep_kernels import fp8

            return fp8.dequantize(w, self.kv_b_proj.weight_scale_inv, self.kv_a_layernorm.weight.dtype)
        return w
