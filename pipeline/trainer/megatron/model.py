"""megatron-core's GPTModel for the Qwen3 / Qwen3-MoE, Qwen2 / Qwen2.5 and Llama 3.x families, and a
forward on our micro-batches.

`transformer_config` maps ModelArgs onto TransformerConfig (RMSNorm, SwiGLU, GQA, RoPE without
interleave; q/k norm for Qwen3, q/k/v bias for Qwen2 (`add_qkv_bias`), no other biases; MoE: softmax
router over top-k as Qwen3-MoE, no aux loss). `build_gpt` gives megatron's rotary embedding the
frequency table of pipeline/models/rope.py (any RoPE type Lockstep reads) and YaRN's cos/sin factor.
The layer spec is megatron's local spec, or Transformer Engine's when it imports and the model is on a GPU.
`logits_at` runs a packed micro-batch (pipeline.trainer.batching.MicroBatch) as a padded [B, T]
batch with a causal+padding mask and returns the logits at the scored positions (under pipeline
parallelism: one stage's part, pipeline/trainer/megatron/stages.py carries activations between them).

Legend: B sequences, T padded length, N packed tokens, M scored positions, V vocab.
"""

from __future__ import annotations

import torch

import lockstep_kernels as kernels
from pipeline.models.config import ModelArgs


def transformer_config(args: ModelArgs, *, tp: int, ep: int, sequence_parallel: bool, dtype: torch.dtype,
                       on_cpu: bool, routing_replay: bool = False, pp: int = 1, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if args.is_moe:
        # pipeline/config/validate.py refuses the others
        assert not args.mlp_only_layers and args.decoder_sparse_step == 1, "megatron runs all-MoE models only"
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.num_experts_per_tok,
                   moe_ffn_hidden_size=args.moe_intermediate_size, moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, moe_router_pre_softmax=not args.norm_topk_prob,
                   # alltoall on GPUs; its split sizes stay tensors on CPU, which gloo refuses
                   moe_token_dispatcher_type="alltoall" if ep > 1 and not on_cpu else "allgather",
                   moe_router_dtype="fp32", moe_enable_routing_replay=routing_replay)
    return TransformerConfig(
        num_layers=args.num_hidden_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps, gated_linear_unit=True,
        activation_func=kernels.silu,  # as pipeline.models (batch invariant when that mode is on)
        add_bias_linear=False, add_qkv_bias=args.qkv_bias, qk_layernorm=args.qk_norm, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype if pp > 1 else None,
        # activation checkpointing of every layer (Miles: --recompute-granularity full --recompute-method uniform)
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
        sequence_parallel=sequence_parallel and tp > 1, params_dtype=torch.float32, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, perform_initialization=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, attention_softmax_in_fp32=True, **moe)


def layer_spec(args: ModelArgs, use_te: bool):
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=args.num_experts or None,
                                                          qk_layernorm=args.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from pipeline.trainer.megatron.layers import CoreAttention, RMSNorm

    spec = get_gpt_layer_local_spec(num_experts=args.num_experts or None, qk_layernorm=args.qk_norm,
                                    normalization="RMSNorm")
    sub = spec.submodules  # megatron's modules, with our norms and core attention (pipeline/trainer/megatron/layers.py)
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    if args.qk_norm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    attn.core_attention = CoreAttention
    return spec


def build_gpt(args: ModelArgs, config, use_te: bool = False, first_stage: bool = True, last_stage: bool = True):
    """GPTModel, or under pipeline parallelism this rank's stage of it: its layers (megatron's even
    split), the embedding on the first stage, the final norm and output layer on the last."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 without Transformer Engine leaves it undefined
        moe_utils.te_general_gemm = None

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from pipeline.trainer.megatron.layers import RMSNorm, patch_linear

    patch_linear()
    spec = layer_spec(args, use_te)
    if not use_te:  # the final norm too
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)
    gpt = GPTModel(config, spec, vocab_size=args.vocab_size,
                   max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                   rotary_base=int(args.rope_theta), share_embeddings_and_output_weights=args.tie_word_embeddings,
                   parallel_output=False, pre_process=first_stage, post_process=last_stage)
    set_rope(gpt, args, config)
    return gpt


def set_rope(gpt, args: ModelArgs, config) -> None:
    """Megatron's rotary embedding with Lockstep's table (pipeline/models/rope.py: every RoPE type, on
    the device megatron computes its own on, so the table is the engine's bit for bit), and YaRN's
    cos/sin factor through the config fields megatron's attention reads for it."""
    from pipeline.models.rope import inv_freq

    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    gpt.rotary_pos_emb.inv_freq, scale = inv_freq(args, device)
    rs = args.rope_scaling
    if rs is not None and rs.rope_type == "yarn":
        both = bool(rs.get("mscale") and rs.get("mscale_all_dim"))  # transformers' condition for the ratio
        config.yarn_rotary_scaling_factor = rs.get("factor")
        config.yarn_mscale = rs.get("mscale") if both else None
        config.yarn_mscale_all_dim = rs.get("mscale_all_dim") if both else None
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        assert _yarn_get_concentration_factor_from_config(config) == scale, "megatron's YaRN factor differs"


def padded_batch(input_ids_N: torch.Tensor, cu_seqlens: torch.Tensor, pad_to: int = 1):
    """(ids [B, T], positions [B, T], mask [B, 1, T, T] True where attention is not allowed, grid index)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    b, t = len(lengths), -(-max(lengths) // pad_to) * pad_to
    dev = input_ids_N.device
    seq = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lengths, device=dev))
    pos = torch.arange(input_ids_N.shape[0], device=dev) - cu_seqlens[:-1][seq]
    ids = torch.zeros(b, t, dtype=input_ids_N.dtype, device=dev)
    ids[seq, pos] = input_ids_N
    positions = torch.arange(t, device=dev).expand(b, t)
    valid = torch.arange(t, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    allowed = causal[None] & valid[:, None, :]
    allowed |= torch.eye(t, dtype=torch.bool, device=dev)[None]  # padded rows attend to themselves
    return ids, positions, ~allowed[:, None], (seq, pos)


def logits_at(model, input_ids_N: torch.Tensor, cu_seqlens: torch.Tensor, score_pos_M: torch.Tensor,
              pad_to: int = 1, hidden_TBD: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [M, V] of the packed stream's positions `score_pos_M` (full vocab on every TP rank). Under
    pipeline parallelism `model` is one stage: a later stage takes the previous one's output
    `hidden_TBD`, and a stage before the last returns its hidden states [T, B, D] instead."""
    ids, positions, mask, (seq, pos) = padded_batch(input_ids_N, cu_seqlens, pad_to)
    if hidden_TBD is not None:
        model.set_input_tensor(hidden_TBD)
    out = model(ids, positions, mask)
    if not model.post_process:
        return out
    return out[seq[score_pos_M], pos[score_pos_M]]
