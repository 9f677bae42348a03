"""Decode attention in Triton: one query per sequence over its slot of the KV cache, split along the keys.

Layers: `_decode_split_kernel` (one program per (sequence, kv head, key split): all query heads of the
group against that split's keys, online softmax in fp32), `_decode_combine_kernel` (merges the splits
by their log-sum-exp), `decode_attention_fwd` (launcher).

The key length of each sequence is read from a device tensor inside the kernel, never from the host,
and the split count depends only on the batch size: one launch serves every decode step of a batch
bucket, so the engine can capture it in a CUDA graph (pipeline/rollout/engine/graphs.py). Inference
only (no autograd).

Batch-invariant mode (`bi_decode_attention`): one split, keys in attention.py's key blocks from 0
upward, and the group's query heads padded to attention.py's 64 query rows: every query row then meets
the same tile shapes, the same online-softmax steps in the same order and the same final division as
in attention.py's `_bi_attention_kernel` (whose tiles hold 64 positions of one head instead of the heads
of one position), so a decode step gets the bits a training forward computes for that token, and
reads each key block once per KV head rather than once per query head and query tile.
Legend: B sequences, H query heads, G kv heads, S cache slots (>= B), T cache length, D head dim,
P key splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep_kernels.gpu.attention import INTERPRET, QUERY_ROWS, key_block, load_kv_block, online_softmax_step
from lockstep_kernels.gpu.grid import checked
from lockstep_kernels.gpu.offsets import offset64


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, lse_ptr,
                         sq_b, sq_h, sk_s, sk_g, sk_t, sv_s, sv_g, sv_t, so_b, so_h, so_p, sl_b, sl_h,
                         P, scale,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr):
    """For split p of sequence b and kv head g: o = softmax(q k^T * scale) v over keys [lo, hi) of the
    split (each split a BLOCK_N-aligned share of keys 0..lens[b]-1), and lse = log sum exp of its scores.
    DIRECT (one split): o is the answer, stored in the output's dtype at o_ptr [B, H, D]; no lse."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    p = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(length, P), BLOCK_N) * BLOCK_N
    lo = p * chunk
    hi = tl.minimum(lo + chunk, length)
    rows = tl.arange(0, GROUP_PAD)
    heads = g * GROUP + rows
    hmask = rows < GROUP
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    # The sequence's (and its cache slot's) start in int64: a slot can start past 2^31 elements (offsets.py)
    k_head = k_ptr + offset64(b, sk_s) + offset64(g, sk_g)
    v_head = v_ptr + offset64(b, sv_s) + offset64(g, sv_g)
    q = tl.load(q_ptr + offset64(b, sq_b) + heads[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        kmask = cols < hi
        k, v = load_kv_block(k_head, v_head, cols, kmask, offs_d, sk_t, sv_t, UPCAST)
        m_i, l_i, acc = online_softmax_step(q, k, v, kmask[None, :], m_i, l_i, acc, scale, IEEE)
    empty = hi <= lo  # a split past the sequence's end: weight 0 in the combine
    out = tl.where(empty, 0.0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)))
    if DIRECT:  # as attention.py's kernel stores its rows: one rounding of acc / l_i to the output dtype
        tl.store(o_ptr + offset64(b, so_b) + heads[:, None] * so_h + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        tl.store(o_ptr + offset64(b, so_b) + offset64(p, so_p) + heads[:, None] * so_h + offs_d[None, :], out,
                 mask=hmask[:, None])
        tl.store(lse_ptr + offset64(b, sl_b) + p + heads * sl_h, lse, mask=hmask)


@triton.jit
def _decode_combine_kernel(o_part_ptr, lse_ptr, out_ptr, so_bh, so_p, sout_b, sout_h, H, P,
                           P_PAD: tl.constexpr, D: tl.constexpr):
    """out[b, h] = sum_p exp(lse_p - lse) o_p, lse = log sum_p exp(lse_p)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    ps = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D)
    pmask = ps < P
    lse = tl.load(lse_ptr + offset64(bh, P) + ps, mask=pmask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    o = tl.load(o_part_ptr + offset64(bh, so_bh) + ps[:, None] * so_p + offs_d[None, :], mask=pmask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + offset64(b, sout_b) + offset64(h, sout_h) + offs_d, out.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, max_len: int, block_n: int, sms: int) -> int:
    """Key splits for a batch: enough programs to fill the GPU about twice, none shorter than a block."""
    want = triton.cdiv(2 * sms, max(1, batch * kv_heads))
    return int(max(1, min(want, 32, triton.cdiv(max_len, block_n))))


def decode_attention_fwd(q_BHD: torch.Tensor, k_SGTD: torch.Tensor, v_SGTD: torch.Tensor, lens_B: torch.Tensor,
                         splits: int | None = None, rows: int | None = None, direct: bool = False) -> torch.Tensor:
    """o[b, h] = attention of query q[b, h] over keys 0..lens[b]-1 of cache slot b (kv head h // (H/G)).
    rows: query rows per program (the group's heads, zero-padded; default the next power of 2, >= 16).
    direct (one split only): the split kernel stores the answer itself, no combine (batch-invariant form;
    the default mode keeps the combine until this form has run on a GPU)."""
    b, h, d = q_BHD.shape
    g, t = k_SGTD.shape[1], k_SGTD.shape[2]
    assert d in (16, 32, 64, 128, 256) and h % g == 0 and k_SGTD.shape[0] >= b, (q_BHD.shape, k_SGTD.shape)
    assert q_BHD.stride(-1) == 1 and k_SGTD.stride(-1) == 1 and v_SGTD.stride(-1) == 1, "head dim must be contiguous"
    block_n = key_block(d)
    group = h // g
    rows = rows or max(16, triton.next_power_of_2(group))
    assert rows >= group and rows == triton.next_power_of_2(rows), (rows, group)
    if splits is None:
        sms = torch.cuda.get_device_properties(q_BHD.device).multi_processor_count if q_BHD.is_cuda else 8
        splits = num_splits(b, g, t, block_n, sms)
    lens = lens_B.to(torch.int32)
    out = torch.empty_like(q_BHD)
    assert not direct or splits == 1, "direct needs one split"
    if direct:  # the split kernel writes the answer itself
        o_part, lse = out.unsqueeze(2), out.new_empty(0, 0)
    else:
        o_part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q_BHD.device)
        lse = torch.empty(b, h, splits, dtype=torch.float32, device=q_BHD.device)
    _decode_split_kernel[checked("decode_attention", (b, g, splits))](
        q_BHD, k_SGTD, v_SGTD, lens, o_part, lse,
        q_BHD.stride(0), q_BHD.stride(1), k_SGTD.stride(0), k_SGTD.stride(1), k_SGTD.stride(2),
        v_SGTD.stride(0), v_SGTD.stride(1), v_SGTD.stride(2), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1), splits, d ** -0.5, GROUP=group, GROUP_PAD=rows, D=d, BLOCK_N=block_n,
        UPCAST=INTERPRET, IEEE=q_BHD.dtype == torch.float32, DIRECT=direct, num_warps=4, num_stages=2,
    )
    if not direct:
        _decode_combine_kernel[(b * h,)](o_part, lse, out, o_part.stride(1), o_part.stride(2), out.stride(0),
                                         out.stride(1), h, splits, P_PAD=max(2, triton.next_power_of_2(splits)), D=d,
                                         num_warps=1)
    return out


def bi_decode_attention(q_BHD: torch.Tensor, k_SGTD: torch.Tensor, v_SGTD: torch.Tensor,
                        lens_B: torch.Tensor) -> torch.Tensor:
    """Batch-invariant decode (module docstring): bitwise attention.py's `bi_attention` of the query at
    position lens[b] - 1, for head dims q = k = v in attention.KERNEL_DIMS and groups of at most 64 heads."""
    assert q_BHD.shape[1] // k_SGTD.shape[1] <= QUERY_ROWS
    return decode_attention_fwd(q_BHD, k_SGTD, v_SGTD, lens_B, splits=1, rows=QUERY_ROWS, direct=True)
