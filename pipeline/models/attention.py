"""How a flat token stream is grouped for attention.

The model runs on a flat stream of N tokens (no padding). An attention *context* tells each
attention layer how those tokens relate: packed independent sequences (training, engine prefill),
or single decode tokens that attend to a KV cache (engine decode). The model code calls
`ctx.attend(layer_idx, q_NHD, k_NKD, v_NKD)` and never needs to know which.

Legend: N tokens in the stream, H query heads, K key/value heads, D head dim, B sequences, T length.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

import lockstep_kernels as kernels


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor) -> torch.Tensor:
        """Return the attention output [N, H, D] for the N tokens of the stream."""
        ...

    def attend_latent(self, layer_idx: int, q_NHD: torch.Tensor, latent_NL: torch.Tensor, mla) -> torch.Tensor:
        """MLA: the attention output [N, H, V] over the stream's latent rows (and those cached before)."""
        ...


def attend_padded(q_BHQD, k_BKTD, v_BKTD, qpos_BQ) -> torch.Tensor:
    """Query (b, i) attends to keys 0..qpos_BQ[b, i] of sequence b (padding queries carry qpos 0)."""
    return kernels.attention(q_BHQD, k_BKTD, v_BKTD, qpos_BQ)


@functools.cache
def keep_attention_out_of_compiled_code() -> None:
    """train.compile: a compiled decoder layer calls PackedCausal.attend as it is (torch.compiler.disable:
    varlen kernels, the grid path). Done when a model is compiled, not as a decorator at import, which
    imported torch._dynamo (~1.3 s) into every process: the launcher, the engines, the rollout side."""
    PackedCausal.attend = torch.compiler.disable(PackedCausal.attend)


class PackedCausal:
    """Independent causal sequences packed back to back: sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1].

    On GPUs in default mode (bf16/fp16) the packed stream goes to flash attention's varlen kernel as it
    is. Otherwise it is scattered into a [B, T] grid for one SDPA call (or the batch-invariant kernel),
    then gathered back, so the model itself never sees padding and no logits are computed for pad
    positions.

    varlen=False takes the padded grid on GPUs too (benchmarks time both paths side by side).
    """

    def __init__(self, cu_seqlens: torch.Tensor, varlen: bool = True):
        assert cu_seqlens.dim() == 1 and cu_seqlens[0] == 0
        self.cu_seqlens = cu_seqlens
        self.varlen = varlen
        self.cu_seqlens_i32: torch.Tensor | None = None  # flash attention's varlen kernel wants int32
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        self.lengths = lengths
        self.max_len = int(lengths.max()) if lengths.numel() else 0
        device = cu_seqlens.device
        n = int(cu_seqlens[-1])
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        pos_in_seq = torch.arange(n, device=device) - cu_seqlens[:-1][seq_of_token]
        self.grid_index = (seq_of_token, pos_in_seq)  # token i sits at grid[seq, pos]
        self.positions = pos_in_seq
        t = torch.arange(self.max_len, device=device)
        # Causal: query i sees keys 0..i. Padded query rows see key 0 only (their output is discarded).
        self.qpos_BT = torch.where(t[None, :] < lengths[:, None], t[None, :], 0)

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu", varlen: bool = True) -> "PackedCausal":
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=device)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long, device=device), 0)
        return cls(cu, varlen)

    def to_grid(self, x_NXD: torch.Tensor) -> torch.Tensor:
        b = len(self.lengths)
        grid = x_NXD.new_zeros(b, self.max_len, *x_NXD.shape[1:])
        grid[self.grid_index] = x_NXD
        return grid

    def attend(self, layer_idx, q_NHD, k_NKD, v_NKD, scale: float | None = None):
        """scale: the softmax scale (None: 1/sqrt(D)); v may have its own head dim (MLA)."""
        if q_NHD.is_cuda and self.varlen and scale is None and v_NKD.shape[-1] == q_NHD.shape[-1]:
            if self.cu_seqlens_i32 is None:
                self.cu_seqlens_i32 = self.cu_seqlens.to(torch.int32)
            o_NHD = kernels.packed_causal_attention(q_NHD, k_NKD, v_NKD, self.cu_seqlens_i32, self.max_len)
            if o_NHD is not None:
                return o_NHD
        q = self.to_grid(q_NHD).transpose(1, 2)
        k = self.to_grid(k_NKD).transpose(1, 2)
        v = self.to_grid(v_NKD).transpose(1, 2)
        o_BHTD = kernels.attention(q, k, v, self.qpos_BT, scale)
        return o_BHTD.transpose(1, 2)[self.grid_index]

    def attend_latent(self, layer_idx, q_NHD, latent_NL, mla):
        """Every token's latent row expanded to keys and values once, then causal attention (training)."""
        k_NHD, v_NHV = mla.expand(latent_NL)
        return self.attend(layer_idx, q_NHD, k_NHD, v_NHV, mla.scale)
