"""A slot-based KV cache and the attention context that reads and writes it.

Each running request owns one slot: a row of [S, K, T, D] key and value tensors per layer. Running
requests are kept compacted in slots 0..B-1 (a finishing request's slot is refilled by moving the
last one down), so a decode step reads a plain slice of the cache instead of gathering rows.

One context class serves prefill (many new tokens per sequence, possibly after a cached prefix) and
decode (one token per sequence): write the new keys/values at their positions, then attend over the
slot's first `pos + 1` positions.

Multi-head Latent Attention (DeepSeek-V3, pipeline/models/mla.py) caches no keys or values: a
`LatentCache` holds each token's latent row (kv_lora_rank + qk_rope_head_dim values per layer), and
`attend_latent` writes the new rows and lets the MLA module attend over the slot's rows (expanded, or
absorbed for default-mode decode steps). `make_cache` picks the cache a model needs.

Legend: S slots, B sequences in this forward, N stream tokens, K kv heads, H query heads, D head dim,
T cache length, Q new tokens per sequence (padded), L latent row (MLA).
"""

from __future__ import annotations

import torch

import lockstep_kernels as kernels
from pipeline.models.attention import attend_padded
from pipeline.models.config import ModelArgs


class KVCache:
    def __init__(self, args: ModelArgs, num_slots: int, max_len: int, dtype: torch.dtype, device):
        shape = (num_slots, args.num_key_value_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_hidden_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache (a memory release frees them)."""
        return self.k + self.v

    def read(self, slot: int, length: int) -> list[torch.Tensor]:
        """Copies of slot's first `length` positions, one [K, length, D] per tensor (the prefix cache keeps them)."""
        return [t[slot, :, :length].clone() for t in self.tensors()]

    def write(self, slot: int, rows: list[torch.Tensor], length: int) -> None:
        """Put `read`'s rows (their first `length` positions) into slot."""
        for t, r in zip(self.tensors(), rows):
            t[slot, :, :length] = r[:, :length]


class LatentCache:
    """MLA's cache: one [S, T, L] tensor of latent rows per layer (`latent`)."""

    def __init__(self, args: ModelArgs, num_slots: int, max_len: int, dtype: torch.dtype, device):
        shape = (num_slots, max_len, args.kv_lora_rank + args.qk_rope_head_dim)
        self.latent = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_hidden_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def move(self, src: int, dst: int, length: int) -> None:
        for lat in self.latent:
            lat[dst, :length] = lat[src, :length]

    def tensors(self) -> list[torch.Tensor]:
        return list(self.latent)

    def read(self, slot: int, length: int) -> list[torch.Tensor]:
        return [t[slot, :length].clone() for t in self.latent]

    def write(self, slot: int, rows: list[torch.Tensor], length: int) -> None:
        for t, r in zip(self.latent, rows):
            t[slot, :length] = r[:length]


def make_cache(args: ModelArgs, num_slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache | LatentCache:
    return (LatentCache if args.is_mla else KVCache)(args, num_slots, max_len, dtype, device)


class CacheAttention:
    """Attention for sequences b=0..B-1 in slots `slots_B`, each adding `new_B[b]` tokens after `start_B[b]` cached ones."""

    def __init__(self, cache: KVCache, slots_B: list[int], start_B: list[int], new_B: list[int], device):
        self.cache = cache
        b = len(slots_B)
        self.contiguous = slots_B == list(range(b))
        self.slots = torch.tensor(slots_B, dtype=torch.long, device=device)
        start = torch.tensor(start_B, dtype=torch.long, device=device)
        new = torch.tensor(new_B, dtype=torch.long, device=device)
        seq_of_token = torch.repeat_interleave(torch.arange(b, device=device), new)
        offsets = torch.cumsum(new, 0) - new
        j = torch.arange(int(new.sum()), device=device) - offsets[seq_of_token]
        self.positions = start[seq_of_token] + j  # absolute position of each stream token
        self.token_slot = self.slots[seq_of_token]
        self.grid_index = (seq_of_token, j)
        self.q_len = int(new.max())
        self.kv_len = int((start + new).max())
        assert self.kv_len <= cache.max_len, "sequence longer than the engine's KV cache"
        qpos_BQ = start[:, None] + torch.arange(self.q_len, device=device)[None, :]
        valid_BQ = torch.arange(self.q_len, device=device)[None, :] < new[:, None]
        # Query at absolute position p sees cache positions 0..p; padded query rows see position 0 only.
        self.qpos_BQ = torch.where(valid_BQ, qpos_BQ, 0)
        self.batch = b

    def attend(self, layer_idx, q_NHD, k_NKD, v_NKD):
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        kc[self.token_slot, :, self.positions] = k_NKD
        vc[self.token_slot, :, self.positions] = v_NKD
        if self.q_len == 1 and self.contiguous:  # decode: one query per sequence, lengths on the device
            return kernels.decode_attention(q_NHD, kc[:, :, : self.kv_len], vc[:, :, : self.kv_len], self.positions + 1)
        if self.contiguous:
            k_BKTD, v_BKTD = kc[: self.batch, :, : self.kv_len], vc[: self.batch, :, : self.kv_len]
        else:
            k_BKTD, v_BKTD = kc[self.slots, :, : self.kv_len], vc[self.slots, :, : self.kv_len]
        o_BHQD = attend_padded(self._grid(q_NHD).transpose(1, 2), k_BKTD, v_BKTD, self.qpos_BQ)
        return o_BHQD.transpose(1, 2)[self.grid_index]

    def attend_latent(self, layer_idx, q_NHD, latent_NL, mla):
        lat = self.cache.latent[layer_idx]
        lat[self.token_slot, self.positions] = latent_NL
        lat_BTL = lat[: self.batch, : self.kv_len] if self.contiguous else lat[self.slots, : self.kv_len]
        o_BHQV = mla.attend_cached(self._grid(q_NHD).transpose(1, 2), lat_BTL, self.qpos_BQ, decode=self.q_len == 1)
        return o_BHQV.transpose(1, 2)[self.grid_index]

    def _grid(self, x_NHD: torch.Tensor) -> torch.Tensor:
        """[B, Q, H, D]: each sequence's new tokens in a row (padding rows zero)."""
        x_BQHD = x_NHD.new_zeros(self.batch, self.q_len, *x_NHD.shape[1:])
        x_BQHD[self.grid_index] = x_NHD
        return x_BQHD
