"""Model architecture settings, read from and written to a Hugging Face `config.json`.

`ModelArgs` covers the Qwen3 (dense) and Qwen3-MoE families. `from_hf` accepts both the legacy
top-level `rope_theta` and transformers 5's `rope_parameters`; `to_hf` writes the layout that real
Qwen3 checkpoints ship, so `transformers.AutoModelForCausalLM.from_pretrained` loads our directories.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import UserError


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
    # MoE (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Multi-token prediction draft layers (Qwen3-Next's mtp_num_hidden_layers); 0 or 1.
    mtp_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mtp_num_hidden_layers not in (0, 1):
            raise UserError(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers}: Lockstep builds at most one MTP layer")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise UserError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
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
        return "qwen3_moe" if self.is_moe else "qwen3"

    def num_params(self) -> int:
        """Parameter count (embedding and head counted once each unless tied)."""
        h, kv, hd = self.hidden_size, self.num_key_value_heads, self.head_dim
        attn = h * self.num_attention_heads * hd * 2 + h * kv * hd * 2 + 2 * hd
        total = 0
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                mlp = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + 2 * h
        emb = self.vocab_size * h
        return total + emb + h + (0 if self.tie_word_embeddings else emb)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise UserError(
                f"model_type {model_type!r} is not supported (Lockstep runs the Qwen3 and Qwen3-MoE families)"
            )
        rope = cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default") if rope else (cfg.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise UserError(f"rope_type {rope_type!r} is not supported yet (only 'default' RoPE)")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        heads = cfg["num_attention_heads"]
        known = {f.name for f in dataclasses.fields(cls)}
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        args = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            initializer_range=cfg.get("initializer_range", 0.02),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=cfg.get("pad_token_id"),
            mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0),
        )
        if model_type == "qwen3_moe":
            args.update(
                num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),  # transformers 5 writes the alias
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=cfg.get("norm_topk_prob", False),  # transformers' default when absent
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            )
        args["extra"] = {k: v for k, v in cfg.items() if k not in known and k not in _HF_DERIVED}
        return cls(**args)

    def to_hf(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "use_sliding_window": False,
            "sliding_window": None,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.is_moe:
            cfg.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=0.0,
                output_router_logits=False,
            )
        if self.mtp_num_hidden_layers:
            cfg["mtp_num_hidden_layers"] = self.mtp_num_hidden_layers
        for k, v in self.extra.items():
            cfg.setdefault(k, v)
        return cfg


# Keys of an HF config that `from_hf` folds into typed fields (so they are not kept in `extra`).
_HF_DERIVED = {
    "architectures", "model_type", "hidden_act", "rope_parameters", "rope_scaling", "torch_dtype", "dtype",
    "attention_dropout", "use_sliding_window", "sliding_window", "max_window_layers", "use_cache",
    "layer_types", "router_aux_loss_coef", "num_nextn_predict_layers", "num_local_experts", "output_router_logits", "transformers_version",
}


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
PRESETS = ("tiny-dense", "tiny-moe", *REAL_SIZES)


def model_preset(name: str, vocab_size: int, bos: int | None, eos: int | None, pad: int | None,
                 mtp_layers: int = 0) -> ModelArgs:
    """The architecture behind `model.init`: small ones for the demo and tests (about 0.1M parameters;
    train in seconds on a CPU) and real Qwen3 sizes for benchmarks on a GPU; `vocab_size` is the
    tokenizer's, `mtp_layers` the MTP draft layers."""
    special = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, mtp_num_hidden_layers=mtp_layers)
    if name in REAL_SIZES:
        shape = {"tie_word_embeddings": True, **REAL_SIZES[name]}
        return ModelArgs(vocab_size=max(vocab_size, QWEN_VOCAB), max_position_embeddings=4096, rope_theta=1e6,
                         **shape, **special)
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
    raise UserError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}, or set model.path")
