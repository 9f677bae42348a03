"""One flat buffer per dtype behind a model's parameters, and fused projections as views of it.

An inference model (the built-in engine's) keeps its parameters as views of one contiguous buffer per
dtype, in `named_parameters()` order: the order the trainer exports a version in
(pipeline/trainer/fsdp.full_state). A weight update whose tensors are views of one exported buffer in
that same layout is then applied as one copy of the whole span (pipeline/models/fp8.load_into), and
a memory release frees one allocation.

The same layout puts q/k/v and gate/up projections side by side, so each pair or triple is also one
weight matrix (a view, no copy): decode runs one GEMM where it ran three (or two). Names, shapes and
checkpoints are unchanged, and every update lands in the fused views too.
"""

from __future__ import annotations

import torch
from torch import nn


def flatten_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Move every parameter into one flat buffer per dtype (values kept; tied parameters stay tied).
    Returns the buffers."""
    params = [p for _, p in model.named_parameters()]
    flats = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.empty(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
        offset = 0
        with torch.no_grad():
            for p in group:
                view = flat[offset: offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
        flats.append(flat)
    return flats


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if contiguous `b` starts where contiguous `a` ends, in the same storage and dtype."""
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())


def adjacent(tensors: list[torch.Tensor]) -> bool:
    """True if the tensors follow each other in one storage and agree past dim 0 (so they concatenate
    along dim 0 as a view)."""
    return (all(t.shape[1:] == tensors[0].shape[1:] for t in tensors)
            and all(follows(a, b) for a, b in zip(tensors, tensors[1:])))


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The dim-0 concatenation of adjacent tensors, as a view of their storage."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def fuse_projections(model: nn.Module) -> int:
    """Give each attention its `qkv_weight` and each dense MLP its `gate_up_weight` where the parts are
    adjacent full-precision weights without biases (flatten_parameters lays them out so). Returns how many
    modules got one. Their forwards use the fused weight outside batch-invariant mode."""
    from pipeline.models.qwen3 import MLP, Attention

    fused = 0
    for m in model.modules():
        if isinstance(m, Attention):
            parts = [m.q_proj, m.k_proj, m.v_proj]
        elif isinstance(m, MLP):
            parts = [m.gate_proj, m.up_proj]
        else:
            continue
        if any(p.bias is not None or p.fp8 or p.weight_transform is not None for p in parts):
            continue
        weights = [p.weight.data for p in parts]
        if not adjacent(weights):
            continue
        setattr(m, "qkv_weight" if isinstance(m, Attention) else "gate_up_weight", joined(weights))
        fused += 1
    return fused



@torch.no_grad()
def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> int:
    """dst[i].copy_(src[i]) for same-dtype, same-shape pairs. A run of pairs laid out alike in both
    (each adjacent to the last in one source and one destination storage: an exported version into
    flattened parameters) is copied as one span; the rest in one multi-tensor copy. Returns the number
    of span copies."""
    rest_d, rest_s, spans = [], [], 0
    i = 0
    while i < len(dst):
        j = i + 1
        while j < len(dst) and follows(dst[j - 1], dst[j]) and follows(src[j - 1], src[j]):
            j += 1
        if j - i > 1:
            n = sum(t.numel() for t in dst[i:j])
            d, s = dst[i], src[i]
            d.as_strided((n,), (1,), d.storage_offset()).copy_(s.as_strided((n,), (1,), s.storage_offset()))
            spans += 1
        else:
            rest_d.extend(dst[i:j])
            rest_s.extend(src[i:j])
        i = j
    if rest_d:
        torch._foreach_copy_(rest_d, rest_s)
    return spans
