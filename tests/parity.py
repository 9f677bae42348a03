"""Comparing Lockstep's decoder with transformers' own classes: the same checkpoint loaded by both,
logits over the same token grid."""

from __future__ import annotations

import torch

from pipeline.models.attention import PackedCausal


def hf_model(path: str):
    """transformers' model of a checkpoint directory, fp32, eager attention (the reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def ours_logits(model, ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of our model over each row of `ids_BT` as its own sequence."""
    b, t = ids_BT.shape
    ctx = PackedCausal.from_lengths([t] * b)
    with torch.no_grad():
        return model(ids_BT.flatten(), ctx.positions, ctx, logits_at_M=torch.arange(b * t)).view(b, t, -1)


def write_random_checkpoint(cfg, path: str, seed: int) -> None:
    """transformers' model of `cfg` with random weights (norms near 1, biases and DeepSeek's expert
    correction bias random too, so one that is not applied shows), saved by save_pretrained."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)
    model.save_pretrained(path)
