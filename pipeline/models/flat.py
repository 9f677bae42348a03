"""One flat buffer per dtype behind a model's parameters.

An inference model (the built-in engine's) keeps its parameters as views of one contiguous buffer per
dtype, in `named_parameters()` order: the order the trainer exports a version in
(pipeline/trainer/fsdp.full_state). A weight update whose tensors are views of one exported buffer in
that same layout is then applied as one copy of the whole span (pipeline/models/fp8.load_into), and
a memory release frees one allocation. Names, shapes and checkpoints are unchanged.
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


def _place(t: torch.Tensor) -> tuple | None:
    """(storage address, dtype, offset, end) of a contiguous tensor; None for any other."""
    if not t.is_contiguous():
        return None
    return t.untyped_storage().data_ptr(), t.dtype, t.storage_offset(), t.storage_offset() + t.numel()


def _follows(a: tuple | None, b: tuple | None) -> bool:
    """True if contiguous `b` starts where contiguous `a` ends, in the same storage and dtype."""
    return a is not None and b is not None and a[:2] == b[:2] and b[2] == a[3]


@torch.no_grad()
def copy_tensors(dst: list[torch.Tensor], src: list[torch.Tensor]) -> int:
    """dst[i].copy_(src[i]) for same-dtype, same-shape pairs. A run of pairs laid out alike in both
    (each adjacent to the last in one source and one destination storage: an exported version into
    flattened parameters) is copied as one span; the rest in one multi-tensor copy. Returns the number
    of span copies."""
    rest_d, rest_s, spans = [], [], 0
    dplace, splace = [_place(t) for t in dst], [_place(t) for t in src]
    i = 0
    while i < len(dst):
        j = i + 1
        while j < len(dst) and _follows(dplace[j - 1], dplace[j]) and _follows(splace[j - 1], splace[j]):
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
