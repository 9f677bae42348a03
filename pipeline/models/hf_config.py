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

import os
from typing import Any

from pipeline.errors import UserError
from pipeline.models.config import ModelArgs, RopeScaling

FAMILY = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "qwen2", "llama": "llama", "deepseek_v3": "deepseek_v3"}
ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
SUPPORTED = "qwen2 (Qwen2 / Qwen2.5), qwen3, qwen3_moe, llama (Llama 3.x), deepseek_v3 (DeepSeek-V3 / R1)"

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
    "deepseek_v3": dict(_COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pretraining_tp=1,
                        rope_interleave=True, attention_bias=False),
}

# Fields read into ModelArgs (or into the RoPE settings), per model_type.
_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
         "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta", "rope_scaling",
         "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings",
         "mtp_num_hidden_layers", "num_nextn_predict_layers", "hidden_act", "attention_dropout"}
_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers"}
# DeepSeek-V3: MLA and its MoE. head_dim / qk_head_dim (transformers writes both, derived) and
# num_key_value_heads (MLA expands one key and value per query head whatever it says; transformers' SDPA
# path ignores it too) are checked, not read.
_DEEPSEEK = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
             "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "attention_bias"}
READ = {"qwen2": _READ, "qwen3": _READ | {"attention_bias"}, "qwen3_moe": _READ | {"attention_bias"} | _MOE,
        "llama": _READ | {"attention_bias", "mlp_bias"},
        "deepseek_v3": (_READ - {"head_dim", "num_key_value_heads", "mtp_num_hidden_layers"}) | _DEEPSEEK}

# Fields of the family accepted only at harmless values (see _check), or at any value: the MoE aux-loss
# settings (a training loss; Lockstep's loss is its own) and pretraining_tp (transformers 4 split the
# same matmuls by it; transformers 5 ignores it).
_SLIDING = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
CHECKED = {"qwen2": _SLIDING | {"use_mrope"}, "qwen3": _SLIDING,
           # Qwen3-MoE checkpoints carry max_window_layers, which transformers' Qwen3-MoE ignores
           "qwen3_moe": _SLIDING | {"output_router_logits", "router_aux_loss_coef"},
           "llama": {"pretraining_tp"},
           # DeepSeek's own config.json fields (its modeling_deepseek.py): the routing method and score
           # function (checked: noaux_tc and sigmoid are what transformers computes), moe_layer_freq
           # (1), and the aux-loss / parallelism settings of its pretraining (ep_size, aux_loss_alpha, seq_aux)
           "deepseek_v3": {"head_dim", "qk_head_dim", "num_key_value_heads", "topk_method", "scoring_func",
                           "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits",
                           "pretraining_tp", "auto_map"}}
# Read and checked, not written back: DeepSeek's auto_map names its own modelling code, which the export
# does not ship (transformers runs its native DeepseekV3ForCausalLM, which Lockstep's model equals).
NOT_WRITTEN = {"auto_map", "head_dim", "qk_head_dim", "num_key_value_heads"}

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
    if model_type is None:
        raise UserError(f"config.json has no model_type (Lockstep runs {SUPPORTED}): is it a model's config.json?")
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
    _check_sizes(cfg, get)
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
    if model_type == "deepseek_v3":
        args.update(_deepseek_args(get, heads))
    if model_type == "qwen3_moe":
        args.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", defaults["num_experts"])),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=get("decoder_sparse_step"),
            mlp_only_layers=tuple(get("mlp_only_layers") or ()),
        )
    kept = (CHECKED[model_type] | HARMLESS | {"original_max_position_embeddings"}) - NOT_WRITTEN
    args["extra"] = {k: v for k, v in cfg.items() if k in kept}
    return ModelArgs(**args)


# The shape's integers: required ones must be there, every one given must be a positive integer (a string,
# a float or a null would otherwise surface as a torch error, or a misleading shape message, after start-up).
REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings", "num_experts",
                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_routed_experts", "n_shared_experts", "n_group", "topk_group")


def _check_sizes(cfg: dict[str, Any], get) -> None:
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = get(key)
        if value is None:
            if key in REQUIRED_SIZES:
                raise UserError(f"config.json has no {key} (null or missing): is it a complete model config?")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"config.json: {key} must be a positive integer (got {value!r})")


def _deepseek_args(get, heads: int) -> dict[str, Any]:
    """ModelArgs fields of a deepseek_v3 config (after _check_deepseek)."""
    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    return dict(
        num_key_value_heads=heads, head_dim=nope + rope, q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=get("v_head_dim"),
        rope_interleave=bool(get("rope_interleave")), num_experts=get("n_routed_experts") or 0,
        num_experts_per_tok=get("num_experts_per_tok") or 0, moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=bool(get("norm_topk_prob")), n_shared_experts=get("n_shared_experts") or 0,
        routed_scaling_factor=float(get("routed_scaling_factor")), n_group=get("n_group"),
        topk_group=get("topk_group"), first_k_dense_replace=get("first_k_dense_replace"),
        mtp_num_hidden_layers=int(get("num_nextn_predict_layers") or 0))


def _check_deepseek(cfg: dict[str, Any], get) -> None:
    """deepseek_v3 fields accepted only at the values transformers' DeepseekV3ForCausalLM computes."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
        if key in cfg and cfg[key] != want:
            raise _refuse(f"{key}={_show(cfg[key])} is not implemented (Lockstep's DeepSeek-V3 router is {key}"
                          f"={want!r}, as transformers' DeepseekV3ForCausalLM)")
    for key in ("n_group", "topk_group", "v_head_dim", "first_k_dense_replace", "qk_nope_head_dim",
                "qk_rope_head_dim", "kv_lora_rank"):
        if get(key) is None:
            raise _refuse(f"{key}=None: DeepSeek-V3 needs a value")
    rope = get("qk_rope_head_dim")
    if "head_dim" in cfg and cfg["head_dim"] != rope:
        raise _refuse(f"head_dim={_show(cfg['head_dim'])} differs from qk_rope_head_dim ({rope}), which"
                      " transformers' DeepSeek-V3 sets it to")
    qk = get("qk_nope_head_dim") + rope
    if "qk_head_dim" in cfg and cfg["qk_head_dim"] != qk:
        raise _refuse(f"qk_head_dim={_show(cfg['qk_head_dim'])} differs from qk_nope_head_dim + qk_rope_head_dim ({qk})")
    auto = cfg.get("auto_map")
    if auto is not None and not (isinstance(auto, dict) and all(
            isinstance(v, str) and v.split(".")[0] in ("configuration_deepseek", "modeling_deepseek")
            for v in auto.values())):
        raise _refuse(f"auto_map={_show(auto)}: custom modelling code other than DeepSeek's own is not run")


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
    if model_type == "deepseek_v3":
        _check_deepseek(cfg, get)
    quant = cfg.get("quantization_config")
    if quant is not None and not _is_lockstep_w4a16(quant) and not is_block_fp8(quant):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise _refuse(f"quantization_config with quant_method={_show(method)}: quantized checkpoints are not loaded"
                      " (only Lockstep's own W4A16 export and DeepSeek's blockwise FP8: quant_method fp8, e4m3,"
                      " weight_block_size [128, 128], dynamic activations); use the unquantized weights")
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


BLOCK_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
"""DeepSeek-V3's published quantization_config: e4m3 weights with one fp32 `weight_scale_inv` per 128 x 128
block (pipeline/models/fp8.py's layout); read_state_dict dequantises it, save_model(fp8=True) writes it."""


def is_block_fp8(quant: Any) -> bool:
    return (isinstance(quant, dict) and quant.get("quant_method") == "fp8"
            and list(quant.get("weight_block_size") or []) == [128, 128]
            and quant.get("fmt", "e4m3") == "e4m3" and quant.get("activation_scheme", "dynamic") == "dynamic"
            and set(quant) <= {"activation_scheme", "fmt", "quant_method", "weight_block_size", "modules_to_not_convert"})


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
        "head_dim": args.rope_dim if args.is_mla else args.head_dim,  # transformers' DeepSeek-V3: the RoPE part
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
    elif args.family == "deepseek_v3":
        cfg.update(_deepseek_fields(args))
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    if args.is_moe and args.family == "qwen3":
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
    if args.mtp_num_hidden_layers and args.family != "deepseek_v3":
        cfg["mtp_num_hidden_layers"] = args.mtp_num_hidden_layers
    for k, v in args.extra.items():
        if k not in ("use_sliding_window", "sliding_window"):  # switched off above (refused when in use)
            cfg.setdefault(k, v)
    return cfg


def _deepseek_fields(args: ModelArgs) -> dict[str, Any]:
    return dict(
        attention_bias=args.attention_bias, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
        rope_interleave=args.rope_interleave, n_routed_experts=args.num_experts, n_shared_experts=args.n_shared_experts,
        num_experts_per_tok=args.num_experts_per_tok, moe_intermediate_size=args.moe_intermediate_size,
        norm_topk_prob=args.norm_topk_prob, routed_scaling_factor=args.routed_scaling_factor, n_group=args.n_group,
        topk_group=args.topk_group, first_k_dense_replace=args.first_k_dense_replace,
        # written even when 0: transformers' default is 1 (the nextn layer: model.layers.<num_hidden_layers>)
        num_nextn_predict_layers=args.mtp_num_hidden_layers)


def read_model_args(model_dir: str) -> ModelArgs:
    """A checkpoint directory's config.json, read strictly (no torch: the launcher checks a run with it
    before anything starts)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise UserError(f"model.path {model_dir!r} has no config.json: point it at a Hugging Face checkpoint directory")
    from pipeline.utils.fs import read_json_object

    return read_hf_config(read_json_object(path))
