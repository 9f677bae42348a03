"""The building blocks every decoder family shares: a Linear whose matmul goes through
lockstep_kernels (batch-invariant when asked, FP8 or INT4-QAT when given), RMSNorm, the SwiGLU MLP,
and the routed experts with their combine. qwen3.py (the decoder), mla.py, deepseek.py and mtp.py
build from them, so none of those needs another's module for a layer.

Routed experts run two ways, with the same bits given the same per-expert matmuls (`run_experts`):
  the loop     one MLP call per expert on its tokens (training: autograd, FSDP, the unused-expert
               trick; and wherever no stacked weights exist);
  stacked      the engine's inference path (`stack_experts`, called by the engine after it loads its
               model): each of gate / up / down for every expert in one kernels.grouped_linear launch over
               [E, N, K] views of the experts' own weights, expert offsets on the device: no host sync,
               CUDA-graph capturable.

Legend: N tokens, D hidden, I expert intermediate size, E experts, k top-k, A = N*k expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass

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


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class StackedExperts:
    """An MoE block's expert weights as [E, N, K] tensors whose slice e is expert e's Linear weight,
    the same memory (a weight update copied into a Linear is what the stacked path reads)."""

    gate_EID: torch.Tensor
    up_EID: torch.Tensor
    down_EDI: torch.Tensor
    cpu: bool = False
    """Take the stacked path on CPU tensors too (tests: kernels.grouped_linear is the per-expert loop there)."""

    def views_of(self, experts: nn.ModuleList) -> bool:
        """True while the first and last experts' weights are still the stacked memory (something that
        replaced the parameters, e.g. flattening them again, would leave the stacked tensors stale)."""
        stacked = (self.gate_EID, self.up_EID, self.down_EDI)
        return all(getattr(experts[e], name).weight.data_ptr() == w[e].data_ptr()
                   for e in (0, len(experts) - 1) for name, w in zip(PROJECTIONS, stacked))


class Experts(nn.ModuleList):
    """An MoE block's routed experts (MLPs; parameter names experts.<e>.{gate,up,down}_proj.weight, as
    checkpoints store them), with their weights stacked once `stack()` ran (the engine's)."""

    stacked: StackedExperts | None = None

    def stack(self, cpu: bool = False) -> bool:
        """Give the experts StackedExperts; False (and none) where the stacked path does not apply: FP8
        weights (Linear.fp8), a weight_transform (INT4 QAT), biases, or weights of unequal shapes or
        dtypes. Where the weights already lie at equal steps in one storage (the engine's flat buffer,
        pipeline/models/flat.py: named_parameters order puts expert e's gate at base + e * 3IK), the
        stacked tensors are strided views of it; otherwise they are new tensors and each Linear's weight
        is re-pointed to its slice. Names, shapes, weight updates (copies into the parameters) and
        checkpoints are unchanged. Call it after anything that replaces parameters (flatten first)."""
        self.stacked = None
        linears = {name: [getattr(mlp, name) for mlp in self] for name in PROJECTIONS}
        for lins in linears.values():
            w0 = lins[0].weight
            if any(lin.fp8 or lin.weight_transform is not None or lin.bias is not None
                   or lin.weight.shape != w0.shape or lin.weight.dtype != w0.dtype or lin.weight.device != w0.device
                   for lin in lins):
                return False
        self.stacked = StackedExperts(*(_stacked_views(linears[name]) for name in PROJECTIONS), cpu=cpu)
        return True


@torch.no_grad()
def _stacked_views(linears: list[Linear]) -> torch.Tensor:
    """[E, N, K] whose slice e is linears[e].weight's memory (see Experts.stack)."""
    weights = [lin.weight.detach() for lin in linears]
    w0 = weights[0]
    step = weights[1].storage_offset() - w0.storage_offset() if len(weights) > 1 else w0.numel()
    evenly = step >= w0.numel() and all(
        w.is_contiguous() and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
        and w.storage_offset() == w0.storage_offset() + e * step for e, w in enumerate(weights))
    if evenly:
        return w0.as_strided((len(weights), *w0.shape), (step, *w0.stride()), w0.storage_offset())
    stacked = torch.stack(weights)
    for lin, view in zip(linears, stacked):
        lin.weight.data = view
    return stacked


def stack_experts(model: nn.Module, cpu: bool = False) -> int:
    """Experts.stack() on every MoE block of `model` (the engine's, after loading and flattening).
    Returns how many blocks got stacked weights. cpu: see StackedExperts.cpu."""
    return sum(m.stack(cpu) for m in model.modules() if isinstance(m, Experts))


def unstack_experts(model: nn.Module) -> None:
    """Every MoE block of `model` back on the per-expert loop (its weights stay where they are)."""
    for m in model.modules():
        if isinstance(m, Experts):
            m.stacked = None


def run_experts(experts: Experts, x_ND: torch.Tensor, idx_Nk: torch.Tensor, w_Nk: torch.Tensor) -> torch.Tensor:
    """out[n] = sum over n's experts, in ascending rank j of the expert among n's experts, of
    (w[n, j] * expert(x[n])) in x's dtype; zeros plus one add per j, each rounded.

    The stacked path where the experts have stacked weights, grad is off (the engine's inference mode)
    and x is on a GPU (or StackedExperts.cpu); the per-expert loop otherwise. Both gather each expert's
    tokens in token order and combine alike, so their outputs are bitwise equal whenever their
    per-expert matmuls are (batch-invariant mode on GPUs: bi_grouped_linear's rows are bi_linear's)."""
    stacked = experts.stacked
    if stacked is not None and not torch.is_grad_enabled() and (x_ND.is_cuda or stacked.cpu):
        assert stacked.views_of(experts), "stacked expert weights are stale: call stack_experts() again after" \
            " replacing parameters"
        return run_experts_stacked(stacked, x_ND, idx_Nk, w_Nk)
    return run_experts_loop(experts, x_ND, idx_Nk, w_Nk)


def _assignments(idx_Nk: torch.Tensor, w_Nk: torch.Tensor):
    """Assignments grouped by expert (stable: tokens ascending within an expert): their order in the
    flat [N*k] routing, token, weight, and destination row n*k + (rank of the expert among n's experts)."""
    n, k = idx_Nk.shape
    order_A = torch.argsort(idx_Nk.reshape(-1), stable=True)
    token_A = order_A // k
    weight_A = w_Nk.reshape(-1)[order_A]
    rank_Nk = torch.argsort(torch.argsort(idx_Nk, dim=1), dim=1)
    dest_A = (torch.arange(n, device=idx_Nk.device)[:, None] * k + rank_Nk).reshape(-1)[order_A]
    return order_A, token_A, weight_A, dest_A


def _sum_over_k(y_AD: torch.Tensor, x_ND: torch.Tensor, k: int, start: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = zeros (+ start) + y[n*k] + y[n*k+1] + ... in ascending j, rounded after each add."""
    y_NkD = y_AD.view(x_ND.shape[0], k, -1)
    out_ND = torch.zeros_like(x_ND) if start is None else torch.zeros_like(x_ND) + start
    for j in range(k):
        out_ND = out_ND + y_NkD[:, j]
    return out_ND


def run_experts_loop(experts: nn.ModuleList, x_ND: torch.Tensor, idx_Nk: torch.Tensor,
                     w_Nk: torch.Tensor) -> torch.Tensor:
    """run_experts by one MLP call per expert. The per-expert token counts reach the host in one read
    per layer (a torch.where per expert read 128 counts one by one: 1,152 device syncs per decode step
    of a 9-layer, 128-expert model)."""
    n, k = idx_Nk.shape
    order_A, token_A, weight_A, dest_A = _assignments(idx_Nk, w_Nk)
    counts = torch.bincount(idx_Nk.reshape(-1), minlength=len(experts)).tolist()
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
    return _sum_over_k(y_AD, x_ND, k, unused)


def run_experts_stacked(stacked: StackedExperts, x_ND: torch.Tensor, idx_Nk: torch.Tensor,
                        w_Nk: torch.Tensor) -> torch.Tensor:
    """run_experts with each projection of every expert in one kernels.grouped_linear call. No host
    sync: per-expert counts by scatter_add into [E] (torch.bincount reads its size on the host on
    CUDA), offsets by cumsum, both on the device."""
    n, k = idx_Nk.shape
    e = stacked.gate_EID.shape[0]
    flat_A = idx_Nk.reshape(-1)
    _, token_A, weight_A, dest_A = _assignments(idx_Nk, w_Nk)
    ones_A = torch.ones_like(flat_A, dtype=torch.int32)
    counts_E = torch.zeros(e, dtype=torch.int32, device=x_ND.device).scatter_add_(0, flat_A, ones_A)
    offsets_E1 = torch.cat([counts_E.new_zeros(1), counts_E.cumsum(0, dtype=torch.int32)])
    x_AD = x_ND[token_A]
    h_AI = (kernels.silu(kernels.grouped_linear(x_AD, stacked.gate_EID, offsets_E1))
            * kernels.grouped_linear(x_AD, stacked.up_EID, offsets_E1))
    y_AD = kernels.grouped_linear(h_AI, stacked.down_EDI, offsets_E1) * weight_A[:, None]
    y_AD = x_ND.new_zeros(n * k, x_ND.shape[1]).index_copy(0, dest_A, y_AD.to(x_ND.dtype))
    return _sum_over_k(y_AD, x_ND, k)
