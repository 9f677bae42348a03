"""config.json <-> ModelArgs: a strict reader and the writer, per model family.

Every field of config.json is one of:
  - read: it sets a ModelArgs field (a field config.json leaves out takes transformers' default for
    that model_type: DEFAULTS, checked against transformers' config classes in the tests);
  - checked: accepted at the values that compute what Lockstep computes (hidden_act silu, no dropout,
    sliding windows switched off, ...), refused at any other;
  - harmless: known not to change the forward (file metadata, generation defaults, token ids, ...);
  - anything else: refused, naming the field and its value.
A refusal is one UserError line (`lockstep: error: config.json: ...`) before anything starts: computing
something other than the checkpoint's model is the worst failure a training system can have.
Checked and harmless fields are kept in `ModelArgs.extra` and written back on export.

RoPE comes as transformers 4 wrote it (`rope_theta` + `rope_scaling`, whose type is `rope_type` or the
legacy `type`) or as transformers 5 does (`rope_parameters` holding rope_theta); transformers 5's
precedence is kept (rope_scaling over rope_parameters; a rope_theta inside over the top-level one), and
the export writes the form that was read.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import UserError
from pipeline.models.config import ModelArgs, RopeScaling

FAMILY = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "qwen2", "llama": "llama"}
ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "llama": "LlamaForCausalLM"}
SUPPORTED = "qwen2 (Qwen2 / Qwen2.5), qwen3, qwen3_moe, llama (Llama 3.x)"

# transformers' defaults (its config classes, version 5) for fields config.json may leave out. None for
# num_key_value_heads / head_dim means "derived": num_attention_heads, hidden_size // num_attention_heads.
_COMMON = dict(hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_dropout=0.0, rope_theta=10_000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_WINDOW = dict(use_sliding_window=False, sliding_window=4096)
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(_COMMON, **_WINDOW, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=None,
                  max_position_embeddings=32768, max_window_layers=28),
    "qwen3": dict(_COMMON, **_WINDOW, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, max_window_layers=28, attention_bias=False),
    "qwen3_moe": dict(_COMMON, **_WINDOW, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=None,
                      max_position_embeddings=32768, attention_bias=False, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                      mlp_only_layers=[]),
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, max_position_embeddings=2048,
                  attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2),
}

# Fields read into ModelArgs (or into the RoPE settings), per model_type.
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
         "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta", "rope_scaling",
         "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings",
         "mtp_num_hidden_layers", "num_nextn_predict_layers", "hidden_act", "attention_dropout"}
_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers"}
READ = {"qwen2": _READ, "qwen3": _READ | {"attention_bias"}, "qwen3_moe": _READ | {"attention_bias"} | _MOE,
        "llama": _READ | {"attention_bias", "mlp_bias"}}

# Fields of the family accepted only at harmless values (see _check), or at any value: the MoE aux-loss
# settings (a training loss; Lockstep's loss is its own) and pretraining_tp (transformers 4 split the
# same matmuls by it; transformers 5 ignores it).
_SLIDING = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
CHECKED = {"qwen2": _SLIDING | {"use_mrope"}, "qwen3": _SLIDING,
           # Qwen3-MoE checkpoints carry max_window_layers, which transformers' Qwen3-MoE ignores
           "qwen3_moe": _SLIDING | {"output_router_logits", "router_aux_loss_coef"},
           "llama": {"pretraining_tp"}}

# Fields of any model_type that never change the forward: describe the file, or are transformers'
# generic PreTrainedConfig / generation settings (Lockstep samples by its own rollout settings).
FILE_FIELDS = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
               "quantization_config"}  # rewritten by the export, not kept
HARMLESS = {
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "finetuning_task", "task_specific_params", "prefix", "tokenizer_class", "keys_to_ignore_at_inference",
    "is_decoder", "tie_encoder_decoder", "sep_token_id", "decoder_start_token_id", "cross_attention_hidden_size",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # generic fields harmless at their defaults only (see _check)
    "is_encoder_decoder", "add_cross_attention", "pruned_heads",
}

# RoPE: the keys transformers reads for each rope_type (besides rope_type / type and rope_theta), and
# the ones it requires.
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ROPE_REQUIRED = {"linear": {"factor"}, "dynamic": {"factor"}, "yarn": {"factor"},
                 "llama3": {"factor", "low_freq_factor", "high_freq_factor"}}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(what: str) -> UserError:
    return UserError(f"config.json: {what}")


def read_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    model_type = cfg.get("model_type")
    if model_type not in FAMILY:
        raise UserError(f"model_type {model_type!r} is not supported (Lockstep runs {SUPPORTED})")
    defaults = DEFAULTS[model_type]

    def get(key: str) -> Any:
        return cfg[key] if key in cfg else defaults.get(key)

    known = READ[model_type] | CHECKED[model_type] | HARMLESS | FILE_FIELDS
    unknown = [k for k in cfg if k not in known]
    if unknown:
        fields = ", ".join(f"{k}={_show(cfg[k])}" for k in unknown)
        raise _refuse(f"{fields}: not {'a field' if len(unknown) == 1 else 'fields'} Lockstep implements for model_type"
                      f" {model_type!r} (it may change the model; remove it only if it does not)")
    _check(cfg, model_type, get)
    heads = get("num_attention_heads")
    eos = get("eos_token_id")
    rope_theta, rope_scaling, rope_form = _read_rope(cfg, get)
    args = dict(
        family=FAMILY[model_type],
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads,
        intermediate_size=get("intermediate_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rope_form=rope_form,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")),
        mlp_bias=bool(get("mlp_bias")),
        initializer_range=get("initializer_range"),
        bos_token_id=get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=get("pad_token_id"),
        mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers")) or 0),
    )
    if model_type == "qwen3_moe":
        args.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", defaults["num_experts"])),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=get("decoder_sparse_step"),
            mlp_only_layers=tuple(get("mlp_only_layers") or ()),
        )
    kept = CHECKED[model_type] | HARMLESS | {"original_max_position_embeddings"}
    args["extra"] = {k: v for k, v in cfg.items() if k in kept}
    return ModelArgs(**args)


def _check(cfg: dict[str, Any], model_type: str, get) -> None:
    """Refuse checked fields at values Lockstep does not compute."""
    if get("hidden_act") != "silu":
        raise _refuse(f"hidden_act={_show(get('hidden_act'))} is not implemented (Lockstep's MLP is SwiGLU with silu)")
    if get("attention_dropout"):
        raise _refuse(f"attention_dropout={_show(get('attention_dropout'))} is not implemented (Lockstep trains without"
                      " dropout): set it to 0.0")
    if cfg.get("use_mrope"):
        raise _refuse(f"use_mrope={_show(cfg['use_mrope'])}: multimodal RoPE is not implemented")
    if cfg.get("is_encoder_decoder") or cfg.get("add_cross_attention"):
        key = "is_encoder_decoder" if cfg.get("is_encoder_decoder") else "add_cross_attention"
        raise _refuse(f"{key}=true: Lockstep runs decoder-only models")
    if cfg.get("pruned_heads"):
        raise _refuse(f"pruned_heads={_show(cfg['pruned_heads'])}: pruned attention heads are not implemented")
    quant = cfg.get("quantization_config")
    if quant is not None and not _is_lockstep_w4a16(quant):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise _refuse(f"quantization_config with quant_method={_show(method)}: quantized checkpoints are not loaded"
                      " (only Lockstep's own W4A16 export); use the unquantized weights")
    window = _sliding_layers(cfg, model_type, get)
    if window:
        layers = f"layers {window[0]}..{window[-1]}" if len(window) > 1 else f"layer {window[0]}"
        raise _refuse(f"use_sliding_window=true with sliding_window={_show(get('sliding_window'))} on {layers}:"
                      " sliding-window attention is not implemented (Lockstep attends over the whole context);"
                      " set use_sliding_window to false only if no sequence will be longer than the window")


def _sliding_layers(cfg: dict[str, Any], model_type: str, get) -> list[int]:
    """The layers transformers runs with a sliding window (none unless use_sliding_window is true)."""
    n, types = get("num_hidden_layers"), cfg.get("layer_types")
    if types is not None and (len(types) != n or set(types) - {"full_attention", "sliding_attention"}):
        raise _refuse(f"layer_types={_show(types)}: expected {n} entries of full_attention / sliding_attention")
    if not get("use_sliding_window") or get("sliding_window") is None:
        return []
    if model_type == "qwen3_moe":  # every layer, as transformers' Qwen3-MoE does
        return list(range(n))
    if types is None:
        return [i for i in range(n) if i >= get("max_window_layers")]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _is_lockstep_w4a16(quant: Any) -> bool:
    """The compressed-tensors pack-quantized layout Lockstep's INT4 QAT exports (pipeline/models/qat.py):
    symmetric INT4 groups of weights, activations unquantized; read_state_dict dequantizes it."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or quant.get("format") != "pack-quantized":
        return False
    groups = list((quant.get("config_groups") or {}).values())
    return bool(groups) and all(
        isinstance(g, dict) and g.get("input_activations") is None and isinstance(g.get("weights"), dict)
        and {k: g["weights"].get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
        == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"} for g in groups)


def _read_rope(cfg: dict[str, Any], get) -> tuple[float, RopeScaling | None, str]:
    """(rope_theta, scaling or None, the form config.json used: "rope_theta" or "rope_parameters")."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    d = cfg.get(name) or {}
    if not isinstance(d, dict):
        raise _refuse(f"{name}={_show(d)} is not a dict")
    d = dict(d)
    form = "rope_parameters" if name == "rope_parameters" and d else "rope_theta"
    theta = d.pop("rope_theta", None)
    theta = get("rope_theta") if theta is None else theta
    rope_type = d.get("rope_type", d.get("type", "default"))
    params = {k: v for k, v in d.items() if k not in ("rope_type", "type")}
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(f"partial_rotary_factor={_show(partial)} is not implemented (RoPE on every head dimension)")
    if rope_type not in ROPE_KEYS:
        raise _refuse(f"{name} rope_type={_show(rope_type)} is not implemented (Lockstep implements "
                      f"{', '.join(ROPE_KEYS)})")
    unknown = sorted(set(params) - ROPE_KEYS[rope_type])
    if unknown:
        raise _refuse(f"{name} {', '.join(f'{k}={_show(params[k])}' for k in unknown)}: not read by rope_type"
                      f" {rope_type!r} (it reads {', '.join(sorted(ROPE_KEYS[rope_type])) or 'rope_theta only'})")
    missing = sorted(ROPE_REQUIRED.get(rope_type, set()) - set(params))
    if missing:
        raise _refuse(f"{name} rope_type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "default":
        return theta, None, form
    if rope_type in ("yarn", "llama3"):  # transformers: a top-level value first, then the dict's, then max_position_embeddings
        params["original_max_position_embeddings"] = cfg.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings") or get("max_position_embeddings"))
    if rope_type == "yarn" and params["factor"] is None:
        params["factor"] = get("max_position_embeddings") / params["original_max_position_embeddings"]
    raw = {k: v for k, v in d.items()}
    return theta, RopeScaling(rope_type, tuple(sorted(params.items())), tuple(raw.items())), form


def write_hf_config(args: ModelArgs) -> dict[str, Any]:
    """The config.json of `args`: the family's fields, RoPE in the form it was read in, then the kept
    harmless fields as they were read."""
    eos = list(args.eos_token_id) if isinstance(args.eos_token_id, tuple) else args.eos_token_id
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE[args.model_type]],
        "model_type": args.model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "rms_norm_eps": args.rms_norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": args.initializer_range,
        "use_cache": True,
        "bos_token_id": args.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": args.pad_token_id,
        "torch_dtype": "float32",
    }
    rope = dict(args.rope_scaling.raw) if args.rope_scaling is not None else None
    if args.rope_form == "rope_parameters":
        cfg["rope_parameters"] = {**(rope or {"rope_type": "default"}), "rope_theta": args.rope_theta}
    else:
        cfg["rope_theta"] = args.rope_theta
        cfg["rope_scaling"] = rope
    if args.family in ("qwen3", "llama"):
        cfg["attention_bias"] = args.attention_bias
    if args.family == "llama":
        cfg["mlp_bias"] = args.mlp_bias
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    if args.is_moe:
        cfg.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=args.decoder_sparse_step,
            mlp_only_layers=list(args.mlp_only_layers),
            router_aux_loss_coef=0.0,
            output_router_logits=False,
        )
    if args.mtp_num_hidden_layers:
        cfg["mtp_num_hidden_layers"] = args.mtp_num_hidden_layers
    for k, v in args.extra.items():
        if k not in ("use_sliding_window", "sliding_window"):  # switched off above (refused when in use)
            cfg.setdefault(k, v)
    return cfg
