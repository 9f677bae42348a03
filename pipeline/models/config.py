"""Model architecture settings, read from and written to a Hugging Face `config.json`.

`ModelArgs` covers the families Lockstep runs with one decoder (pipeline/models/qwen3.py): Qwen3 and
Qwen3-MoE, Qwen2 / Qwen2.5, Llama 3.x and DeepSeek-V3. They differ in a few switches read from the config
(`family`, `attention_bias`, `mlp_bias`; q/k norm and q/k/v bias follow from the family) and in RoPE
(`rope_theta`, `rope_scaling`). The DeepSeek-V3 family (`deepseek_v3`) swaps in Multi-head Latent
Attention (pipeline/models/mla.py: the `*_lora_rank` / `*_head_dim` fields) and the DeepSeek MoE block
(pipeline/models/deepseek.py: shared experts, sigmoid router with a selection-only correction bias,
group-limited top-k, routed scaling, the first `first_k_dense_replace` layers dense).
pipeline/models/hf_config.py reads config.json into ModelArgs strictly (`read_hf_config`: a field that
would change the computation and that Lockstep does not implement is refused by name) and writes the
family's layout back (`write_hf_config`), RoPE scaling in the form it was read in, so
`transformers.AutoModelForCausalLM.from_pretrained` loads our directories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pipeline.errors import UserError

FAMILIES = ("qwen3", "qwen2", "llama", "deepseek_v3")  # qwen3 with experts is Qwen3-MoE


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of config.json (`rope_scaling`, or transformers 5's `rope_parameters`).

    rope_type: `linear`, `dynamic`, `yarn` or `llama3` (pipeline/models/rope.py computes them as
    transformers' modeling_rope_utils does). params: the dict's other entries (rope_theta lives in
    ModelArgs), read by `get`. `raw` is the dict as config.json wrote it (a legacy `type` key
    included), so the export writes it back the same way; it takes no part in comparisons."""

    rope_type: str
    params: tuple[tuple[str, Any], ...] = ()
    raw: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self._params.get(key, default)

    @cached_property
    def _params(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    # The family: "qwen3" (q/k RMSNorm, biases as attention_bias says), "qwen2" (q/k/v bias, no o_proj
    # bias, no q/k norm), "llama" (no q/k norm; attention_bias on q/k/v/o, mlp_bias on the MLP).
    family: str = "qwen3"
    mlp_bias: bool = False
    # None: plain RoPE with rope_theta.
    rope_scaling: RopeScaling | None = None
    # MoE (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Multi-token prediction draft layers (Qwen3-Next's mtp_num_hidden_layers); 0 or 1.
    mtp_num_hidden_layers: int = 0
    # DeepSeek-V3 (family "deepseek_v3"; inert elsewhere). Multi-head Latent Attention: q through a
    # rank-q_lora_rank bottleneck (None: one q_proj), k/v from a kv_lora_rank latent (the engine's KV
    # cache) plus one shared qk_rope_head_dim RoPE key; head_dim is qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # RoPE on interleaved pairs (x0, x1), (x2, x3), ... (transformers' rope_interleave; DeepSeek's layout).
    rope_interleave: bool = False
    # DeepSeek MoE: num_experts routed experts (n_routed_experts) plus n_shared_experts always-on ones
    # (one MLP of n_shared_experts x moe_intermediate_size), sigmoid scores, top-k among the topk_group
    # best of n_group expert groups, weights x routed_scaling_factor; layers < first_k_dense_replace dense.
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a tuple when config.json lists several
    pad_token_id: int | None = None
    # Harmless config.json fields (pipeline/models/hf_config.py's allow-list), written back as read.
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # "rope_parameters" when config.json wrote RoPE transformers 5's way (written back the same way).
    rope_form: str = field(default="rope_theta", compare=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UserError(f"model family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mtp_num_hidden_layers not in (0, 1):
            raise UserError(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers}: Lockstep builds at most one MTP layer")
        if self.is_moe and self.family not in ("qwen3", "deepseek_v3"):
            raise UserError(f"num_experts={self.num_experts}: Lockstep runs mixture-of-experts models of the Qwen3-MoE"
                            " and DeepSeek-V3 families only")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise UserError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.is_mla:
            self._check_deepseek()

    def _check_deepseek(self) -> None:
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0:
            raise UserError("deepseek_v3 needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim > 0")
        if self.qk_rope_head_dim % 2:
            raise UserError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates pairs)")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise UserError(f"head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim"
                            f" ({self.qk_nope_head_dim} + {self.qk_rope_head_dim})")
        if self.num_key_value_heads != self.num_attention_heads:
            raise UserError(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads"
                            f" ({self.num_attention_heads}): Multi-head Latent Attention expands one key and value"
                            " per query head from the latent")
        if not self.is_moe:
            return
        e, g = self.num_experts, self.n_group
        if g < 1 or e % g or e // g < 2:
            raise UserError(f"n_group ({g}) must divide n_routed_experts ({e}) into groups of at least 2 experts"
                            " (a group's score is the sum of its two best)")
        if not 1 <= self.topk_group <= g:
            raise UserError(f"topk_group ({self.topk_group}) must be in 1..n_group ({g})")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise UserError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group"
                            f" ({self.topk_group}) groups of {e // g}")

    @property
    def is_moe(self) -> bool:
        """The model has MoE layers (a DeepSeek-V3 whose first_k_dense_replace covers every layer has none)."""
        if self.is_mla:
            return self.num_experts > 0 and self.first_k_dense_replace < self.num_hidden_layers
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V3) instead of GQA."""
        return self.family == "deepseek_v3"

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: every head dimension, or MLA's decoupled RoPE part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.is_mla:  # DeepSeek-V3: every layer from first_k_dense_replace on
            return self.is_moe and layer_idx >= self.first_k_dense_replace
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def model_type(self) -> str:
        if self.family == "qwen3" and self.is_moe:
            return "qwen3_moe"
        return self.family

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head of q and k before RoPE (Qwen3)."""
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        return self.family != "qwen2" and self.attention_bias

    def check_context_length(self, length: int, what: str) -> None:
        """Refuse sequences for which Lockstep's computation would differ from transformers': dynamic
        NTK RoPE is a fixed table only while every sequence fits max_position_embeddings (beyond, it
        changes with the batch's longest sequence, which the trainer and engines do not share)."""
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic" and length > self.max_position_embeddings:
            raise UserError(
                f"rope_scaling rope_type 'dynamic' with {what} {length} > max_position_embeddings"
                f" ({self.max_position_embeddings}): dynamic NTK RoPE then depends on each batch's longest"
                f" sequence, which trainer and engines do not share; shorten sequences to"
                f" {self.max_position_embeddings} tokens")

    def attention_params(self) -> int:
        """Parameters of one attention block (projections, q/k or MLA norms, biases)."""
        h, kv, hd, H = self.hidden_size, self.num_key_value_heads, self.head_dim, self.num_attention_heads
        if self.is_mla:
            c, r, q = self.kv_lora_rank, self.qk_rope_head_dim, self.q_lora_rank
            attn = (h * q + q + q * H * hd) if q else h * H * hd  # q_a_proj, q_a_layernorm, q_b_proj / q_proj
            attn += h * (c + r) + c + c * H * (self.qk_nope_head_dim + self.v_head_dim)  # kv_a, its norm, kv_b
            attn += H * self.v_head_dim * h  # o_proj
            return attn + ((q or 0) + c + r + h if self.attention_bias else 0)  # q_a, kv_a, o_proj biases
        attn = h * H * hd * 2 + h * kv * hd * 2
        attn += 2 * hd if self.qk_norm else 0
        attn += (H + 2 * kv) * hd if self.qkv_bias else 0
        return attn + (h if self.o_proj_bias else 0)

    def mlp_params(self, layer_idx: int) -> tuple[int, int]:
        """(dense, routed-expert) parameters of layer `layer_idx`'s MLP: a dense MLP, or the router (and
        DeepSeek's correction bias and shared experts) beside the routed experts."""
        h = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0), 0
        dense = self.num_experts * h
        if self.is_mla:
            dense += self.num_experts + 3 * h * self.moe_intermediate_size * self.n_shared_experts
        return dense, self.num_experts * 3 * h * self.moe_intermediate_size

    def num_params(self) -> int:
        """Parameter count (embedding and head counted once each unless tied)."""
        h = self.hidden_size
        total = sum(self.attention_params() + sum(self.mlp_params(i)) + 2 * h for i in range(self.num_hidden_layers))
        emb = self.vocab_size * h
        return total + emb + h + (0 if self.tie_word_embeddings else emb)



# Sizes of real Qwen3-class models for `model.init` (randomly initialised; the vocabulary is padded to
# Qwen's 151936 rows as real checkpoints are, so sampling and logprobs cost what they cost there).
# qwen3-0.5b has Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV heads, head dim 64, tied embeddings);
# qwen3-1.7b and qwen3-4b are Qwen3-1.7B's and Qwen3-4B's shapes (tied embeddings).
# qwen3-moe-small is Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
# 768, top-8 with norm_topk_prob, every layer MoE, untied embedding and LM head) with 9 of its 48
# layers (6.2B parameters): the most that train on one H200 beside a colocated engine with 10% to spare.
# pipeline/config/memory.py at configs/bench-0.5b.yaml's sizes with engine.colocated and
# train.recompute_activations: 8 layers ~115 GiB, 9 ~124, 10 ~134, 11 ~143 of ~139 (each layer adds
# ~9.3 GiB of fp32 weights, gradients and AdamW states); without recompute 9 layers need ~152.
REAL_SIZES = {
    "qwen3-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       head_dim=64, intermediate_size=4864),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728),
    "qwen3-moe-small": dict(hidden_size=2048, num_hidden_layers=9, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False),
}
QWEN_VOCAB = 151936
DEEPSEEK_VOCAB = 129280
# deepseek-v3-small: DeepSeek-V3's layers at their real widths (MLA: 128 heads, q_lora_rank 1536,
# kv_lora_rank 512, qk dims 128 + 64, v 128, RoPE on interleaved pairs; the router: 256 routed experts in
# 8 groups, top-8 within the best 4 groups, correction bias, routed scaling 2.5, one shared expert;
# layer 0 dense with intermediate 18432; untied embeddings, vocabulary 129280) with three layers (0
# dense, 1 and 2 MoE) and one change: the experts' intermediate size is 128, not 2048. At 2048 one MoE
# layer alone holds 256 x 3 x 7168 x 2048 = 11.3B parameters, 180 GB of fp32 weights, gradients and
# AdamW states: no layer count of DeepSeek-V3's own MoE layer trains on one 141 GB GPU.
# pipeline/config/memory.py at configs/bench-0.5b.yaml's sizes with engine.colocated and
# train.recompute_activations (4.2B parameters): ~123 GiB of ~139, 10% to spare; a fourth layer ~136;
# two layers with the experts at 256: ~127. Colocated alone ~142, recompute alone ~139, neither ~158.
DEEPSEEK_V3_LAYER = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, head_dim=192,
                         q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, rope_interleave=True, intermediate_size=18432, num_experts=256,
                         num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, n_group=8,
                         topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                         tie_word_embeddings=False, family="deepseek_v3", vocab_size=DEEPSEEK_VOCAB,
                         rope_theta=10_000.0, rms_norm_eps=1e-6)
REAL_SIZES["deepseek-v3-small"] = dict(DEEPSEEK_V3_LAYER, num_hidden_layers=3, moe_intermediate_size=128)
# Small models for learning demos on a GPU: Qwen3 layers at the tokenizer's own vocabulary (Lockstep's
# character tokenizer: 66 rows, not Qwen's 151936, whose embedding alone would hold 117M parameters at
# width 768). char-100m: hidden 768, 12 layers of 12 query / 4 KV heads of 64, MLP 3072, tied embeddings:
# 104M parameters (configs/multidigit-*.yaml, bench/gpu_learning.py).
CHAR_SIZES = {
    "char-100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, intermediate_size=3072),
}
TINY_PRESETS = ("tiny-dense", "tiny-moe", "deepseek-v3-tiny")
PRESETS = (*TINY_PRESETS, *CHAR_SIZES, *REAL_SIZES)


def model_preset(name: str, vocab_size: int, bos: int | None, eos: int | None, pad: int | None,
                 mtp_layers: int = 0) -> ModelArgs:
    """The architecture behind `model.init`: small ones for the demo and tests (about 0.1M parameters;
    train in seconds on a CPU), char-sized ones for learning demos on a GPU, and real Qwen3 sizes for benchmarks on a GPU; `vocab_size` is the
    tokenizer's, `mtp_layers` the MTP draft layers."""
    special = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, mtp_num_hidden_layers=mtp_layers)
    if name in REAL_SIZES:
        shape = {"tie_word_embeddings": True, "vocab_size": QWEN_VOCAB, "rope_theta": 1e6, **REAL_SIZES[name]}
        shape["vocab_size"] = max(vocab_size, shape["vocab_size"])
        return ModelArgs(max_position_embeddings=4096, **shape, **special)
    if name in CHAR_SIZES:
        return ModelArgs(vocab_size=vocab_size, tie_word_embeddings=True, rope_theta=10_000.0,
                         max_position_embeddings=1024, **CHAR_SIZES[name], **special)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        max_position_embeddings=512,
        rope_theta=10_000.0,
        **special,
    )
    if name == "tiny-dense":
        return ModelArgs(**common)
    if name == "tiny-moe":
        return ModelArgs(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    if name == "deepseek-v3-tiny":  # DeepSeek-V3's structure at tiny-moe's scale: MLA with a q LoRA, a dense
        # first layer, then 8 routed experts in 4 groups (top-2 within the best 2 groups) + 1 shared
        mla = dict(num_key_value_heads=4, head_dim=16 + 8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, family="deepseek_v3", num_hidden_layers=3)
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)
        return ModelArgs(**{**common, **mla}, **moe)
    raise UserError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}, or set model.path")
