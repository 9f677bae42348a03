"""A multi-token-prediction (MTP) draft head, Qwen3-Next / Qwen3-MoE-MTP style, and its training inputs.

The head predicts token i+2 from the main model's final hidden state at position i (before the final
norm) and the embedding of token i+1: both normed, concatenated [embedding, hidden], projected back
to D by `fc`, run through one decoder layer with its own attention, then the shared final norm
layout and the main model's LM head. Parameter names match SGLang's Qwen3MoeForCausalLMMTP loader:
mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm. The embedding
and LM head are the policy's own, passed in (not copied). DeepSeek-V3's nextn layer is the same module
(its checkpoint names are mapped in pipeline/models/deepseek.py).

Trained alongside the policy with its own loss (train.mtp_loss_scaling_factor); its inputs are
detached there, so the draft head never changes the policy's gradient. The built-in engine drafts
with it (pipeline/rollout/engine/speculative.py).

Legend: N stream tokens, M scored tokens, D hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lockstep_kernels as kernels

from pipeline.models.config import ModelArgs
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.layers import Linear, RMSNorm
from pipeline.models.rope import rope_cos_sin


class MtpHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        d = args.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(d, args.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, args.rms_norm_eps)
        self.fc = Linear(2 * d, d, bias=False)
        # attends through the context's layer 0; DeepSeek-V3's nextn layer is an MoE layer (as layers past
        # first_k_dense_replace are), Qwen's is built like the model's layer 0
        moe_idx = 0 if args.is_mla and args.is_moe_layer(args.num_hidden_layers) else None
        self.layers = nn.ModuleList([DecoderLayer(args, 0, moe_idx=moe_idx)])
        self.norm = RMSNorm(d, args.rms_norm_eps)

    def forward(self, hidden_ND, next_ids_N, positions_N, ctx, embed_VD, head_VD, at_M=None):
        """(logits [M, V] at rows `at_M` (all rows when None), the head's own hidden states [N, D]).

        Row i combines the main model's hidden state at position i with token i+1; its logits predict
        token i+2. The returned hidden states stand in for the main model's when drafting further ahead."""
        emb_ND = F.embedding(next_ids_N, embed_VD)
        x_ND = self.fc(torch.cat((self.pre_fc_norm_embedding(emb_ND), self.pre_fc_norm_hidden(hidden_ND)), -1))
        cos, sin = rope_cos_sin(positions_N, self.args, x_ND.dtype)
        x_ND = self.layers[0](x_ND, cos, sin, ctx, None)
        h = x_ND if at_M is None else x_ND[at_M]
        return kernels.linear(self.norm(h), head_VD, None), x_ND


def mtp_inputs(input_ids_N: torch.Tensor, cu_seqlens: torch.Tensor, score_pos_M: torch.Tensor):
    """Training inputs of the head for a packed micro-batch.

    next_ids_N: token i+1 of each stream position (0 at each sequence's last position, unused);
    at_M: the row whose MTP logits predict scored token m (one before the main model's row);
    valid_M: False where that row would fall before its sequence's start (a one-token prompt)."""
    next_ids_N = torch.zeros_like(input_ids_N)
    next_ids_N[:-1] = input_ids_N[1:]
    next_ids_N[cu_seqlens[1:] - 1] = 0
    seq_of_M = torch.searchsorted(cu_seqlens, score_pos_M, right=True) - 1
    at_M = score_pos_M - 1
    valid_M = at_M >= cu_seqlens[seq_of_M]
    return next_ids_N, at_M.clamp(min=0), valid_M
