"""The building blocks every decoder family shares: a Linear whose matmul goes through
lockstep_kernels (batch-invariant when asked, FP8 or INT4-QAT when given), RMSNorm, the SwiGLU MLP,
and the routed experts' combine. qwen3.py (the decoder), mla.py, deepseek.py and mtp.py build from
them, so none of those needs another's module for a layer.

Legend: N tokens, D hidden, E experts, k top-k, A = N*k expert assignments.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep_kernels as kernels


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose matmul goes through kernels.linear.

    `weight_transform` (None, or e.g. INT4 fake quantisation for QAT: pipeline/models/qat.py) maps the
    stored weight to the one the forward uses. An FP8 rollout engine's target layers hold an e4m3
    weight and its block scales instead (pipeline/models/fp8.py)."""

    weight_transform = None
    fp8 = False  # True once pipeline/models/fp8.py gave it an FP8 weight and a `weight_scale_inv`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            from lockstep_kernels import fp8

            return fp8.linear(x, self.weight, self.weight_scale_inv, self.bias)
        w = self.weight if self.weight_transform is None else self.weight_transform(self.weight)
        return kernels.linear(x, w, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter) that skips its N(0, 1) fill on the meta device: a model built there
    (hf_io.load_model) gets its values loaded next, and the fill would import torch's Python
    decompositions and dynamo first (~2 s of CPU in every process that loads a model)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(kernels.silu(self.gate_proj(x)) * self.up_proj(x))


def run_experts(experts: nn.ModuleList, x_ND: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
    """out[n] = sum over n's experts e, in ascending e, of (w[n, e] * expert_e(x[n])) in x's dtype.

    Each expert runs once on its tokens, gathered in token order; the per-token sum adds in ascending
    expert id with a rounding after each add (what one index_add per expert computes). The per-expert
    token counts reach the host in one read per layer (a torch.where per expert read 128 counts one by
    one: 1,152 device syncs per decode step of a 9-layer, 128-expert model)."""
    n, k = idx_Nk.shape
    flat_A = idx_Nk.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)  # assignments grouped by expert, tokens ascending within
    counts = torch.bincount(flat_A, minlength=len(experts)).tolist()
    token_A = order_A // k
    weight_A = w_Nk.reshape(-1)[order_A]
    # where each assignment goes: row n, column = its expert's rank among n's experts
    rank_Nk = torch.argsort(torch.argsort(idx_Nk, dim=1), dim=1)
    dest_A = (torch.arange(n, device=idx_Nk.device)[:, None] * k + rank_Nk).reshape(-1)[order_A]
    y_AD = x_ND.new_zeros(n * k, x_ND.shape[1])
    unused = x_ND.new_zeros(())
    start = 0
    for expert, count in zip(experts, counts):
        if count == 0:
            # Keep every expert in the graph so FSDP/DDP see the same parameters used on all ranks.
            unused = unused + 0.0 * expert(x_ND[:0]).sum()
            continue
        rows = slice(start, start + count)
        y = expert(x_ND[token_A[rows]]) * weight_A[rows, None]
        y_AD = y_AD.index_copy(0, dest_A[rows], y.to(x_ND.dtype))
        start += count
    y_NkD = y_AD.view(n, k, -1)
    out_ND = torch.zeros_like(x_ND) + unused
    for j in range(k):
        out_ND = out_ND + y_NkD[:, j]
    return out_ND
