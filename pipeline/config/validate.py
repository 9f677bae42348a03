"""Checks of a run config against the model it trains: what the config alone cannot tell.

The config's own checks (ranges, and settings that exclude each other) run in its dataclasses'
`__post_init__` (schema.py), as it loads. What needs the model's shape (ModelArgs: config.json of
model.path, or the model.init preset) is here, in one function, `validate(cfg, args)`: the launcher
calls it before anything starts (pipeline/launch/prepare.py) and each training backend again on the
checkpoint it loads. Pure Python (no torch, nothing of the trainer), so the check is instant.
"""

from __future__ import annotations

from pipeline.config.schema import RunConfig
from pipeline.errors import ConfigError
from pipeline.models.config import ModelArgs


def validate(cfg: RunConfig, args: ModelArgs) -> None:
    """Refuse a run that `args`' model cannot do as configured; every error names the fix."""
    args.check_context_length(cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len,
                              "data.max_prompt_len + rollout.rollout_max_response_len")
    t = cfg.train
    if t.int4_qat:
        if not args.is_moe:
            raise ConfigError("train.int4_qat quantizes MoE expert weights, and this model has none"
                              " (model.init=tiny-moe, or a Qwen3-MoE checkpoint)")
        # the experts' projections' input sizes (megatron: down_proj's is split over TP ranks)
        tp = t.tensor_model_parallel_size if t.backend == "megatron" else 1
        for what, size in (("hidden_size", args.hidden_size), ("moe_intermediate_size / TP", args.moe_intermediate_size // tp)):
            if size % t.int4_group_size:
                raise ConfigError(f"train.int4_group_size ({t.int4_group_size}) does not divide the experts' input"
                                  f" size {what} ({size}): pick a divisor of it")
    if t.compile and args.is_moe:
        raise ConfigError("train.compile is for dense models: MoE layers keep Python routing state (R3)")
    if t.backend == "megatron":
        _megatron(cfg, args)


def _megatron(cfg: RunConfig, args: ModelArgs) -> None:
    t = cfg.train
    check_megatron_model(args)
    check_parallel(args, t.tensor_model_parallel_size, t.expert_model_parallel_size, t.pipeline_model_parallel_size)
    if not args.is_moe:
        return
    if args.mlp_only_layers or args.decoder_sparse_step != 1:
        raise ConfigError("train.backend=megatron runs Qwen3-MoE models whose every layer is MoE (this one has"
                          " mlp_only_layers or decoder_sparse_step != 1): use train.backend=fsdp")
    if cfg.determinism.true_on_policy:
        raise ConfigError("train.backend=megatron is bit-exact with the engine for dense models only: megatron's"
                          " MoE router and expert combine add in another order (use train.backend=fsdp for"
                          " true on-policy MoE)")
    if t.tensor_model_parallel_size > 1 and not t.sequence_parallel:
        raise ConfigError("megatron runs MoE layers under tensor parallelism only with sequence parallelism:"
                          " set train.sequence_parallel=true (or use train.expert_model_parallel_size)")


DEEPSEEK_REFUSAL = (
    "train.backend=megatron does not run deepseek_v3 models yet: Lockstep's conversion layer maps no MLA or"
    " DeepSeek-MoE weights (megatron-core 0.16.1 has MLASelfAttention and sigmoid group-limited routing with"
    " an expert bias, but scores a group by its top num_experts_per_tok / topk_group experts where DeepSeek"
    " takes the top 2, and always renormalises sigmoid weights): use train.backend=fsdp")


def check_megatron_model(args: ModelArgs) -> None:
    """Refuse what megatron's layers cannot express: a bias on o_proj or the MLP (megatron's
    add_bias_linear puts one on every linear layer at once) and a YaRN attention_factor given
    explicitly (megatron derives the factor from factor / mscale / mscale_all_dim); DeepSeek-V3 is not
    converted yet."""
    if args.is_mla:
        raise ConfigError(DEEPSEEK_REFUSAL)
    rs = args.rope_scaling
    refuse = {
        f"attention_bias=true on model_type {args.model_type!r} (o_proj bias)": args.o_proj_bias,
        "mlp_bias=true": args.mlp_bias,
        "rope_scaling attention_factor": rs is not None and rs.get("attention_factor") is not None,
    }
    bad = [k for k, v in refuse.items() if v]
    if bad:
        raise ConfigError(f"train.backend=megatron does not support {', '.join(bad)}: use train.backend=fsdp")


def check_parallel(args: ModelArgs, tp: int, ep: int, pp: int = 1) -> None:
    """How megatron's layout splits the model: layers over pipeline stages, KV heads over TP ranks,
    experts over EP ranks (pipeline/trainer/megatron/convert.py relies on it)."""
    if args.num_hidden_layers % pp:
        raise ConfigError(f"num_hidden_layers ({args.num_hidden_layers}) must be divisible by pipeline parallel"
                          f" size {pp} (train.pipeline_model_parallel_size)")
    if args.num_key_value_heads % tp:
        raise ConfigError(f"num_key_value_heads ({args.num_key_value_heads}) must be divisible by tensor parallel"
                          f" size {tp} (train.tensor_model_parallel_size)")
    if args.is_moe and args.num_experts % ep:
        raise ConfigError(f"num_experts ({args.num_experts}) must be divisible by expert parallel size {ep}"
                          " (train.expert_model_parallel_size)")
    if not args.is_moe and ep != 1:
        raise ConfigError("expert parallelism needs a MoE model: set train.expert_model_parallel_size=1")
