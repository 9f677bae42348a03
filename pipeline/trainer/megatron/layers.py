"""Lockstep's own kernels inside megatron-core's layers.

megatron's local spec keeps its parallel linear layers, TransformerLayer and MoE, but its norm and
core attention are these modules, which call the same kernels as pipeline.models (kernels.rms_norm,
kernels.attention: SDPA on GPUs instead of megatron's unfused masked softmax). In batch-invariant
mode (determinism.true_on_policy) megatron's linear layers go through kernels.linear too
(`patch_linear`), so a dense model at TP=1 computes the engine's logprobs bit for bit.

Shapes follow megatron: [s, b, ...] sequence-major.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep_kernels as kernels


class RMSNorm(nn.Module):
    """megatron's norm constructor signature, kernels.rms_norm inside (parameter `weight`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        if getattr(config, "sequence_parallel", False):
            setattr(self.weight, "sequence_parallel", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class CoreAttention(nn.Module):
    """Causal GQA attention over a padded [s, b] batch (queries see keys 0..their own position, as
    pipeline.models.attention does; padding rows come after each sequence and are never scored)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout=None, softmax_scale=None, **_):
        super().__init__()
        self.config = config
        assert softmax_scale is None, "Lockstep's core attention uses 1/sqrt(head_dim)"

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None
        s, b = query.shape[0], query.shape[1]
        q_BHQD, k_BGTD, v_BGTD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        qpos_BQ = torch.arange(s, device=query.device).expand(b, s)
        o_BHQD = kernels.attention(q_BHQD, k_BGTD, v_BGTD, qpos_BQ)
        return o_BHQD.permute(2, 0, 1, 3).reshape(s, b, -1)


class _InvariantLinear(torch.autograd.Function):
    """Forward through kernels.linear (batch invariant); backward as a plain linear layer's."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernels.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype)
        return grad.matmul(weight.to(grad.dtype)), grad_w, (g2.sum(0) if ctx.has_bias else None)


def patch_linear() -> None:
    """Route megatron's parallel linear layers through kernels.linear while batch-invariant mode is on
    (TP=1 only: no gradient all-reduce happens in the replacement), and a weight marked by
    `mark_int4_qat` through the INT4 fake quantiser (straight-through gradient)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_lockstep_patched", False):
        return
    original = layers.linear_with_grad_accumulation_and_async_allreduce

    def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kwargs):
        qat = getattr(weight, "lockstep_int4", None)
        if qat is not None:
            from lockstep_kernels import int4

            weight = int4.fake_quant(weight, *qat)
        if kernels.is_batch_invariant():
            assert not allreduce_dgrad and not sequence_parallel, "batch-invariant megatron layers need TP=1"
            return _InvariantLinear.apply(input, weight, bias)
        return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                        *args, **kwargs)

    linear.warned = original.warned  # megatron keeps a one-time warning flag on the function
    layers.linear_with_grad_accumulation_and_async_allreduce = linear
    layers._lockstep_patched = True


def mark_int4_qat(model: nn.Module, group_size: int, scale_dtype: torch.dtype) -> int:
    """INT4 QAT of the MoE experts' projections (as pipeline/models/qat.py for our model): their
    forward uses fake_quant(W). Groups run along each shard's input dimension, which is HF's (fc1 =
    [gate; up] rows over D; fc2 = down's columns, a TP rank's F / TP of them), so the values equal
    the whole weight's quantisation when the group size divides the shard. Returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if ".experts." in name and name.endswith(("linear_fc1.weight", "linear_fc2.weight")):
            if p.shape[1] % group_size:
                raise ValueError(f"train.int4_group_size {group_size} does not divide {name}'s input size"
                                 f" {p.shape[1]} on this rank")
            p.lockstep_int4 = (group_size, scale_dtype)
            n += 1
    return n


class ValueHead(nn.Module):
    """PPO's critic head in GPTModel's `output_layer` place: hidden [s, b, D] -> values [s, b, 1], the
    same on every TP rank (replicated weights). Under sequence parallelism the rank's slice of the
    sequence is gathered first; backward keeps the rank's own slice of the (replicated) gradient."""

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = nn.Parameter(torch.zeros(1))
        self.sequence_parallel = sequence_parallel  # GPTModel reads it

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return kernels.linear(hidden, self.weight, self.bias), None
