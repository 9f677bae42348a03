"""The decoder of every family Lockstep runs (RMSNorm, RoPE, GQA, SwiGLU), with an optional top-k MoE block.

Qwen3 / Qwen3-MoE, Qwen2 / Qwen2.5, Llama 3.x and DeepSeek-V3 are one module with a few switches read
from the config (ModelArgs): q/k RMSNorm (Qwen3), q/k/v bias (Qwen2, or attention_bias), o_proj bias
(attention_bias outside Qwen2), MLP bias (Llama's mlp_bias), and the RoPE type (pipeline/models/rope.py).
DeepSeek-V3 layers take Multi-head Latent Attention (pipeline/models/mla.py) and, from
first_k_dense_replace on, the DeepSeek MoE block (pipeline/models/deepseek.py) instead.
One module serves the trainer and the built-in engine. It runs on a flat stream of tokens; an
attention context (pipeline.models.attention) says how the tokens group into sequences or attend to a
KV cache, and an optional `MoeRouting` records or replays (R3) the experts each token is sent to.
Parameter names equal the Hugging Face checkpoint names of each family, so `state_dict()` loads from
and saves to real checkpoints unchanged. The parts: layers.py (Linear, RMSNorm, MLP, the experts'
combine), decoder_layer.py (a decoder layer, its attention, the Qwen3-MoE block, MoeRouting), mla.py and
deepseek.py (DeepSeek-V3's attention and MoE block), mtp.py (the multi-token-prediction head).

Legend: N tokens, D hidden, H query heads, K kv heads, Hd head dim, V vocab, E experts, k top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.attention import AttentionContext
from pipeline.models.config import ModelArgs
from pipeline.models.decoder_layer import DecoderLayer, MoeRouting
from pipeline.models.layers import Embedding, Linear, RMSNorm
from pipeline.models.rope import rope_cos_sin


class Qwen3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """The causal LM. The LM head runs inside `forward` (only at the positions asked for), so wrappers
    such as FSDP2 see one forward per step."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Qwen3Model(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if args.mtp_num_hidden_layers:
            from pipeline.models.mtp import MtpHead

            self.mtp = MtpHead(args)

    def forward(
        self,
        input_ids_N: torch.Tensor,
        positions_N: torch.Tensor,
        ctx: AttentionContext,
        routing: MoeRouting | None = None,
        logits_at_M: torch.Tensor | None = None,
        return_hidden: bool = False,
        mtp_next_ids_N: torch.Tensor | None = None,
        mtp_at_M: torch.Tensor | None = None,
    ):
        """Final hidden states [N, D]; or, with `logits_at_M`, logits [M, V] at those stream positions only.

        return_hidden: also the last layer's output [N, D] before the final norm (what the MTP head reads).
        mtp_next_ids_N / mtp_at_M (training): also the MTP head's logits at rows `mtp_at_M`, computed
        from detached hidden states and detached embedding / LM-head weights, so its loss trains the
        head alone. Extra results come back as a tuple (logits, hidden or MTP logits)."""
        x_ND = self.model.embed_tokens(input_ids_N)
        cos, sin = rope_cos_sin(positions_N, self.args, x_ND.dtype)
        for layer in self.model.layers:
            x_ND = layer(x_ND, cos, sin, ctx, routing)
        if logits_at_M is None:
            return self.model.norm(x_ND)
        logits_MV = self.lm_head(self.model.norm(x_ND[logits_at_M]))
        if mtp_next_ids_N is not None:
            mtp_logits, _ = self.mtp(x_ND.detach(), mtp_next_ids_N, positions_N, ctx,
                                     self.model.embed_tokens.weight.detach(), self.lm_head.weight.detach(), mtp_at_M)
            return logits_MV, mtp_logits
        if return_hidden:
            return logits_MV, x_ND
        return logits_MV

    def draft(self, hidden_ND, next_ids_N, positions_N, ctx, at_M=None):
        """The MTP head at inference (engine drafting): (logits at `at_M`, head hidden states)."""
        return self.mtp(hidden_ND, next_ids_N, positions_N, ctx, self.model.embed_tokens.weight,
                        self.lm_head.weight, at_M)

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "") -> None:
        """Hugging Face's initialisation: N(0, initializer_range) for linear/embedding, ones for norms.
        `prefix` limits it to the parameters under that name (e.g. "mtp." for a fresh draft head)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.args.initializer_range
        for name, p in self.named_parameters():
            if not name.startswith(prefix):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
