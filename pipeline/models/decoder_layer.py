"""One decoder layer of every family (pre-norm attention + MLP or MoE, residuals), its GQA attention,
the Qwen3-MoE block and the routing state R3 records and replays. The whole model (embedding, layers,
final norm, LM head, MTP head) is qwen3.py; the MTP head (mtp.py) builds its layer from here too.

Legend: N tokens, D hidden, H query heads, K kv heads, Hd head dim, E experts, k top-k.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep_kernels as kernels

from pipeline.models.attention import AttentionContext
from pipeline.models.config import ModelArgs
from pipeline.models.layers import MLP, Experts, Linear, RMSNorm, run_experts
from pipeline.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.q_proj = Linear(h, self.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * hd, bias=args.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * hd, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * hd, h, bias=args.o_proj_bias)
        self.qk_norm = args.qk_norm
        if self.qk_norm:  # Qwen3: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def forward(self, x_ND, cos, sin, ctx: AttentionContext, layer_idx: int):
        n = x_ND.shape[0]
        q = self.q_proj(x_ND).view(n, self.n_heads, self.head_dim)
        k = self.k_proj(x_ND).view(n, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x_ND).view(n, self.n_kv, self.head_dim)
        o_NHD = ctx.attend(layer_idx, q, k, v)
        return self.o_proj(o_NHD.reshape(n, self.n_heads * self.head_dim))


class MoeRouting:
    """Per-forward routing state: record live top-k experts, and compare with (or replay, R3) a trace.

    trace_NLk: the engine's expert ids [N, num_moe_layers, k]; rows of -1 mean "no trace" (route live).
    replay: route by the trace instead of the live top-k (rollout routing replay).
    mismatch/compared count, per MoE layer, traced tokens whose live top-k set differs from the trace.
    A recompute (activation checkpointing) routes identically: the trace is read, never consumed.
    A plain class on purpose: FSDP2 rebuilds dataclass arguments when it casts forward inputs, which
    would send the recorded lists to a copy.
    """

    def __init__(self, trace_NLk: torch.Tensor | None = None, replay: bool = False, record: bool = False,
                 jitter: float = 0.0):
        self.trace_NLk, self.replay, self.record = trace_NLk, replay, record
        self.jitter = jitter  # fault injection only (pipeline/faults.py: engine_router_jitter)
        self.recorded: list[torch.Tensor] = []
        self.mismatch: list[torch.Tensor] = []
        self.compared: list[torch.Tensor] = []

    def perturb(self, moe_idx: int, logits_NE: torch.Tensor) -> torch.Tensor:
        """Router logits with the fault injection's noise (engine_router_jitter; unchanged without it)."""
        if not self.jitter:
            return logits_NE
        gen = torch.Generator(logits_NE.device).manual_seed(moe_idx)
        noise = torch.randn(logits_NE.shape, generator=gen, device=logits_NE.device)
        return logits_NE + (self.jitter * noise).to(logits_NE.dtype)

    def select(self, moe_idx: int, choice_NE: torch.Tensor, k: int) -> torch.Tensor:
        """The experts [N, k] of MoE layer `moe_idx`: the live top-k of `choice_NE` (whatever the router
        ranks by), compared with the trace, replaced by it when replaying, and recorded."""
        live_Nk = kernels.topk_indices(choice_NE, k)
        idx_Nk = live_Nk
        if self.trace_NLk is not None:
            trace_Nk = self.trace_NLk[:, moe_idx].long()
            known_N1 = (trace_Nk >= 0).all(-1, keepdim=True)
            differs = (live_Nk.sort(-1).values != trace_Nk.sort(-1).values).any(-1) & known_N1[:, 0]
            self.mismatch.append(differs.sum().detach())
            self.compared.append(known_N1.sum().detach())
            if self.replay:
                idx_Nk = torch.where(known_N1, trace_Nk, live_Nk)
        if self.record:
            self.recorded.append(idx_Nk.detach())
        return idx_Nk

    def route(self, moe_idx: int, logits_NE: torch.Tensor, k: int, norm_topk: bool):
        """Qwen3-MoE's router: softmax, top-k, the chosen probabilities (renormalised if norm_topk)."""
        probs_NE = kernels.softmax(self.perturb(moe_idx, logits_NE))
        idx_Nk = self.select(moe_idx, probs_NE, k)
        weights_Nk = probs_NE.gather(-1, idx_Nk)
        if norm_topk:
            weights_Nk = weights_Nk / weights_Nk.sum(-1, keepdim=True)
        return idx_Nk, weights_Nk.to(logits_NE.dtype)

    def mismatch_counts(self, num_moe_layers: int) -> tuple[float, float]:
        """(tokens x layers whose live routing differs from the trace, tokens x layers compared),
        counting each layer once even if activation recompute routed it twice."""
        m = self.mismatch[:num_moe_layers]
        c = self.compared[:num_moe_layers]
        return float(sum(float(x) for x in m)), float(sum(float(x) for x in c))


def default_route(logits_NE: torch.Tensor, k: int, norm_topk: bool):
    return MoeRouting().route(0, logits_NE, k, norm_topk)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts))

    def forward(self, x_ND, routing: MoeRouting | None, moe_idx: int):
        logits_NE = self.gate(x_ND)
        if routing is None:
            idx_Nk, w_Nk = default_route(logits_NE, self.top_k, self.norm_topk)
        else:
            idx_Nk, w_Nk = routing.route(moe_idx, logits_NE, self.top_k, self.norm_topk)
        return run_experts(self.experts, x_ND, idx_Nk, w_Nk)


class DecoderLayer(nn.Module):
    """Decoder layer `layer_idx` (its attention reads the context's cache of that layer). `moe_idx` >= 0:
    the MLP is an MoE block routed as MoE layer moe_idx, -1: dense (default: as the model's layer
    layer_idx is; the MTP head's layer passes its own)."""

    def __init__(self, args: ModelArgs, layer_idx: int, moe_idx: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        if moe_idx is None:
            moe_idx = args.moe_layers.index(layer_idx) if args.is_moe_layer(layer_idx) else -1
        self.moe_idx = moe_idx
        if args.is_mla:
            from pipeline.models.deepseek import DeepseekMoE
            from pipeline.models.mla import MLAttention

            self.self_attn = MLAttention(args)
            moe_block = DeepseekMoE
        else:
            self.self_attn = Attention(args)
            moe_block = SparseMoeBlock
        self.mlp = (moe_block(args) if self.moe_idx >= 0
                    else MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x_ND, cos, sin, ctx, routing):
        x_ND = x_ND + self.self_attn(self.input_layernorm(x_ND), cos, sin, ctx, self.layer_idx)
        h = self.post_attention_layernorm(x_ND)
        if self.moe_idx >= 0:
            return x_ND + self.mlp(h, routing, self.moe_idx)
        return x_ND + self.mlp(h)
