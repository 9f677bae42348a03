"""Hugging Face state dicts (Qwen3 / Qwen3-MoE, Qwen2 / Qwen2.5, Llama 3.x) <-> megatron-core GPTModel
(local layer spec) shards.

Pure functions on {name: tensor} dicts. Megatron fuses what HF keeps apart and shards along TP/EP:
  - linear_qkv: per query group g, the rows [q heads of g | k of g | v of g]; TP splits groups. A
    q/k/v bias (Qwen2; `add_qkv_bias`) is fused the same way into linear_qkv.bias. q/k norms
    (q_layernorm, k_layernorm) exist for Qwen3 only.
  - linear_fc1: [gate | up] of each TP rank's slice of the intermediate dimension.
  - column-parallel (qkv, fc1, output layer, embedding rows) split dim 0; row-parallel (proj, fc2)
    split dim 1; norms and the router are replicated.
  - experts: rank r of EP holds experts r*E/ep .. (r+1)*E/ep - 1 as local_experts.0..
`to_megatron` gives one (tp_rank, ep_rank)'s shard; `to_hf` takes every TP rank's shards (for each
EP rank's experts) and rebuilds the HF dict. Round trips are exact: only slicing and concatenation.
Pipeline stages: `stage_shard` keeps a stage's layers (renumbered from 0, as megatron names them)
and ends, `global_names` turns a stage's names back; a tied embedding's copy on the last stage is
megatron's `output_layer.weight` there.

Legend: D hidden, H heads, G query groups (kv heads), d head dim, F intermediate, E experts.
"""

from __future__ import annotations

import re

import torch

from pipeline.config.validate import check_parallel
from pipeline.models.config import ModelArgs

HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _split(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of {tuple(t.shape)} is not divisible by tensor parallel size {size}")
    return t.chunk(size, dim)[rank].clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Weights [rows, D] or biases [rows] of q, k, v -> megatron's fused rows, grouped per kv head."""
    g, d = args.num_key_value_heads, args.head_dim
    per = args.num_attention_heads // g
    rest = q.shape[1:]
    q_g = q.reshape(g, per * d, *rest)
    return torch.cat((q_g, k.reshape(g, d, *rest), v.reshape(g, d, *rest)), 1).reshape(-1, *rest)


def unfuse_qkv(qkv: torch.Tensor, args: ModelArgs, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = args.head_dim
    per = args.num_attention_heads // args.num_key_value_heads
    rest = qkv.shape[1:]
    x = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = x.split([per * d, d, d], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(hf: dict[str, torch.Tensor], args: ModelArgs, tp_rank: int = 0, tp_size: int = 1,
                ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The shard of (tp_rank, ep_rank), named like GPTModel(local spec).state_dict()."""
    check_parallel(args, tp_size, ep_size)
    col = lambda t: _split(t, 0, tp_rank, tp_size)  # noqa: E731
    row = lambda t: _split(t, 1, tp_rank, tp_size)  # noqa: E731
    out = {"embedding.word_embeddings.weight": col(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    if not args.tie_word_embeddings:
        out["output_layer.weight"] = col(hf["lm_head.weight"])
    per_rank = args.num_experts // ep_size if args.is_moe else 0
    for i in range(args.num_hidden_layers):
        h = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        qkv = fuse_qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                       hf[h + "self_attn.v_proj.weight"], args)
        out[m + "self_attention.linear_qkv.weight"] = col(qkv)  # whole groups per rank
        if args.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = col(fuse_qkv(
                hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], args))
        out[m + "self_attention.linear_proj.weight"] = row(hf[h + "self_attn.o_proj.weight"])
        if args.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"].clone()
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        if args.is_moe_layer(i):
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"].clone()
            for j in range(per_rank):
                e = f"{h}mlp.experts.{ep_rank * per_rank + j}."
                x = f"{m}mlp.experts.local_experts.{j}."
                out[x + "linear_fc1.weight"] = torch.cat((col(hf[e + "gate_proj.weight"]), col(hf[e + "up_proj.weight"])))
                out[x + "linear_fc2.weight"] = row(hf[e + "down_proj.weight"])
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat((col(hf[h + "mlp.gate_proj.weight"]),
                                                          col(hf[h + "mlp.up_proj.weight"])))
            out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
    return out


_TP_SPLIT = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|word_embeddings|output_layer)\.")


def tp_sharded(name: str) -> bool:
    """Whether TP ranks hold different parts of megatron weight `name` (to_megatron's col/row splits);
    the rest (norms, the router) is the same on every TP rank."""
    return bool(_TP_SPLIT.search(name))


MG_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def stage_shard(shard: dict[str, torch.Tensor], args: ModelArgs, layers: range, first: bool, last: bool
                ) -> dict[str, torch.Tensor]:
    """The part of a whole-model shard that one pipeline stage holds, in its own names."""
    out = {}
    for name, t in shard.items():
        m = MG_LAYER.fullmatch(name)
        if m:
            i = int(m.group(1))
            if i in layers:
                out[f"decoder.layers.{i - layers.start}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            if first:
                out[name] = t
            if last and not first and args.tie_word_embeddings:
                out["output_layer.weight"] = t  # the last stage's copy of the tied embedding
        elif last:  # final norm, output layer
            out[name] = t
    return out


def global_names(stage: dict[str, torch.Tensor], args: ModelArgs, layers: range) -> dict[str, torch.Tensor]:
    """A stage's shard in whole-model names (the inverse of stage_shard); a tied embedding's copy is dropped."""
    out = {}
    for name, t in stage.items():
        m = MG_LAYER.fullmatch(name)
        if m:
            out[f"decoder.layers.{int(m.group(1)) + layers.start}.{m.group(2)}"] = t
        elif not (name == "output_layer.weight" and args.tie_word_embeddings):
            out[name] = t
    return out


def to_hf(shards: list[list[dict[str, torch.Tensor]]], args: ModelArgs) -> dict[str, torch.Tensor]:
    """shards[ep_rank][tp_rank]: every rank's Megatron shard -> the full HF state dict."""
    tp_size, ep_size = len(shards[0]), len(shards)
    check_parallel(args, tp_size, ep_size)
    first = shards[0]
    col = lambda name, sh=first: torch.cat([s[name] for s in sh], 0)  # noqa: E731
    row = lambda name, sh=first: torch.cat([s[name] for s in sh], 1)  # noqa: E731
    out = {"model.embed_tokens.weight": col("embedding.word_embeddings.weight"),
           "model.norm.weight": first[0]["decoder.final_layernorm.weight"].clone()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if args.tie_word_embeddings else col("output_layer.weight")
    groups = args.num_key_value_heads // tp_size
    per_rank = args.num_experts // ep_size if args.is_moe else 0
    for i in range(args.num_hidden_layers):
        h = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        for kind in ("weight", "bias") if args.qkv_bias else ("weight",):
            parts = [unfuse_qkv(s[m + f"self_attention.linear_qkv.{kind}"], args, groups) for s in first]
            for n, name in enumerate(("q_proj", "k_proj", "v_proj")):
                out[h + f"self_attn.{name}.{kind}"] = torch.cat([p[n] for p in parts], 0)
        out[h + "self_attn.o_proj.weight"] = row(m + "self_attention.linear_proj.weight")
        if args.qk_norm:
            out[h + "self_attn.q_norm.weight"] = first[0][m + "self_attention.q_layernorm.weight"].clone()
            out[h + "self_attn.k_norm.weight"] = first[0][m + "self_attention.k_layernorm.weight"].clone()
        out[h + "input_layernorm.weight"] = first[0][m + "input_layernorm.weight"].clone()
        out[h + "post_attention_layernorm.weight"] = first[0][m + "pre_mlp_layernorm.weight"].clone()

        def unfuse_fc(prefix: str, sh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            gates, ups = zip(*(s[prefix + "linear_fc1.weight"].chunk(2, 0) for s in sh))
            return torch.cat(gates, 0), torch.cat(ups, 0), torch.cat([s[prefix + "linear_fc2.weight"] for s in sh], 1)

        if args.is_moe_layer(i):
            out[h + "mlp.gate.weight"] = first[0][m + "mlp.router.weight"].clone()
            for ep_rank, sh in enumerate(shards):
                for j in range(per_rank):
                    g_, u_, d_ = unfuse_fc(f"{m}mlp.experts.local_experts.{j}.", sh)
                    e = f"{h}mlp.experts.{ep_rank * per_rank + j}."
                    out[e + "gate_proj.weight"], out[e + "up_proj.weight"], out[e + "down_proj.weight"] = g_, u_, d_
        else:
            g_, u_, d_ = unfuse_fc(m + "mlp.", first)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"], out[h + "mlp.down_proj.weight"] = g_, u_, d_
    return out
