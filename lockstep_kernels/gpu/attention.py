"""Batch-invariant causal GQA attention in Triton (forward), for both prefill and KV-cache decode.

Layers: `block_scores`, `softmax_update`, `online_softmax_step` and `load_kv_block` (one key block, shared with
lockstep_kernels/gpu/decode_attention.py),
`_bi_attention_kernel` (one program per BLOCK_M queries of one (sequence, head)), `attention_fwd`
(launcher), `BiAttention` (autograd: backward recomputes through torch's SDPA), `bi_attention`.

Query (b, i) attends to keys 0..qpos[b, i] (queries of a sequence have consecutive positions; padding
rows carry 0 and come back as zeros). Query tiles are aligned to absolute positions. Keys are visited in BLOCK_N blocks from position 0
upward with an online softmax in fp32. A block past a query's position contributes exactly nothing
(max unchanged, rescale exp(0) = 1, probabilities exp(-inf) = 0), so a query gets the same bits
whether it sits in a 2k-token training sequence or is a single decode query over a cache of any
length. Block sizes are pinned per head dim; nothing depends on the batch.
Legend: B sequences, H query heads, G kv heads, Q queries, T keys, D head dim.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lockstep_kernels.gpu.grid import checked
from lockstep_kernels.gpu.offsets import offset64

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def block_scores(q, k, scale, IEEE: tl.constexpr):
    """q k^T * scale for one key block (fp32; IEEE: true fp32 products, not TF32)."""
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    return tl.dot(q, tl.trans(k)) * scale


@triton.jit
def softmax_update(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """The online softmax's update by one key block's scores `s` (-inf where a key is not attended):
    the running max m_i, denominator l_i and output accumulator acc rescaled and updated (fp32)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One key block of an online softmax: scores where `valid`, then the update. Returns (m_i, l_i, acc).
    Every block goes through the mask, fully attended ones too: on an H100 (2026-12-07) a kernel that
    skipped it for those blocks changed 1-4 in 10^4 of its bf16 outputs (the compiled code of the two
    loops differs; not looked into further), so the mask is part of the bits."""
    s = tl.where(valid, block_scores(q, k, scale, IEEE), float("-inf"))
    return softmax_update(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def load_kv_block(k_row_ptr, v_row_ptr, cols, kmask, offs_d, sk_t, sv_t, UPCAST: tl.constexpr):
    """Keys and values at positions `cols` ([BLOCK_N, D], 0 where not `kmask`) of one KV head, whose
    position 0 is at k_row_ptr / v_row_ptr; fp32 when UPCAST."""
    k = tl.load(k_row_ptr + cols[:, None] * sk_t + offs_d[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(v_row_ptr + cols[:, None] * sv_t + offs_d[None, :], mask=kmask[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


QUERY_ROWS = 64  # query rows per tile (BLOCK_M): one Hopper warpgroup MMA's rows at num_warps=4


def key_block(d: int) -> int:
    """Keys per block (BLOCK_N) at head dim d. The key blocks fix the order of the online softmax's
    reduction, so every kernel that must reproduce this one's bits visits keys in these blocks."""
    return 64 if d <= 128 else 32


@triton.jit
def _bi_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qstart_ptr, qlen_ptr,
                         sq_b, sq_h, sq_q, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_h, so_q,
                         H, G, T, scale,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """o[b, h, i] = sum_{t <= p} softmax_t(q[b, h, i] . k[b, g, t] * scale) v[b, g, t] for the query at
    absolute position p = qstart[b] + i, g = h // (H / G).

    Tiles are aligned to absolute positions: the query at position p is row p % BLOCK_M of tile
    p // BLOCK_M, and key t is column t % BLOCK_N of key block t // BLOCK_N, whether the query comes
    from a prefill or a single decode step. So every product and sum a query takes part in sits at
    the same place in the same-shaped tiles in both cases.

    Scheduling only (PREFILL_CONFIG; no bit changes): HEAVY_FIRST launches the query tiles with the most
    keys first (the GPU starts programs in grid order, and the last tiles of a causal sequence are the
    longest: started last, they leave the SMs idle at the end).
    """
    bh = tl.program_id(0)  # sequences x heads on the first axis: the one that allows 2^31 - 1 (grid.py)
    pid = tl.program_id(1)
    if HEAVY_FIRST:
        pid = tl.num_programs(1) - 1 - pid
    b = bh // H
    h = bh % H
    g = h // (H // G)
    qstart = tl.load(qstart_ptr + b)
    qlen = tl.load(qlen_ptr + b)
    tile = qstart // BLOCK_M + pid
    pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # absolute position of each row
    i = pos - qstart  # query index of each row
    rows = (i >= 0) & (i < qlen)
    if tile * BLOCK_M < qstart + qlen:
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        # This sequence's and head's start in int64 (a cache slot can start past 2^31 elements, offsets.py)
        q_head = q_ptr + offset64(b, sq_b) + offset64(h, sq_h)
        k_head = k_ptr + offset64(b, sk_b) + offset64(g, sk_g)
        v_head = v_ptr + offset64(b, sv_b) + offset64(g, sv_g)
        o_head = o_ptr + offset64(b, so_b) + offset64(h, so_h)
        q = tl.load(q_head + i[:, None] * sq_q + offs_d[None, :], mask=rows[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        qpos = tl.where(rows, pos, 0)  # rows that are not queries attend to key 0 and are not stored
        kv_end = tl.minimum(tl.max(qpos, axis=0) + 1, T)
        for start in range(0, kv_end, BLOCK_N):
            cols = start + offs_n
            kmask = cols < T
            k, v = load_kv_block(k_head, v_head, cols, kmask, offs_d, sk_t, sv_t, UPCAST)
            m_i, l_i, acc = online_softmax_step(q, k, v, (cols[None, :] <= qpos[:, None]) & kmask[None, :],
                                                m_i, l_i, acc, scale, IEEE)
        out = acc / l_i[:, None]
        tl.store(o_head + i[:, None] * so_q + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


def query_spans(qpos_BQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first position, number of queries) per sequence. Queries of a sequence have consecutive
    positions; padding rows carry position 0 (both attention contexts build qpos that way)."""
    q = qpos_BQ.shape[1]
    qstart = qpos_BQ[:, 0]
    consecutive = qpos_BQ == qstart[:, None] + torch.arange(q, device=qpos_BQ.device)[None, :]
    return qstart.to(torch.int32).contiguous(), consecutive.sum(1).to(torch.int32).contiguous()


def attention_grid(b: int, h: int, q: int, block_m: int = QUERY_ROWS) -> tuple[int, int]:
    """(sequences x heads, query tiles): a span of q positions touches at most cdiv(q, block_m) + 1
    aligned tiles; the product that grows with the batch on the first axis (grid.py)."""
    return checked("bi_attention", (b * h, triton.cdiv(q, block_m) + 1))


# The launch of the prefill / training kernel: query rows per program, warps, pipeline stages. Scheduling
# only: the key blocks (key_block) fix each query's reduction, and a query's row in its tile does not
# matter to the GPU's MMAs (tests/triton_checks.py bi_decode compares 64-row decode tiles of GQA heads with
# this kernel bitwise), so `bench/bi_attention_probe.py` may pick another one where it shows the same
# bits and more speed (tests/triton_checks.py attention_configs checks them again). Three stages: the
# probe on an H100 (bench/results/h100/probes/bi_attention_probe.json) found 0 configurations with other
# bits and s3 the fastest at every preset's 8k / 16k-token micro-batch, 0.41-0.45x -> 0.46-0.49x of flash.
# HEAVY_FIRST (the kernel's docstring) is scheduling too: on an H100 (2026-12-07, the same probe) it kept
# every bit at all six shapes and was the fastest equal configuration at each, 1-9% faster than without it
# (0.46-0.49x -> 0.48-0.51x of flash; bench/results/h100/probes/bi_attention_heavy_first.json), and
# attention_configs / attention / bi_decode pass with it pinned.
PREFILL_CONFIG = dict(BLOCK_M=QUERY_ROWS, num_warps=4, num_stages=3, HEAVY_FIRST=True)


def attention_fwd(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale: float | None = None, cfg: dict | None = None) -> torch.Tensor:
    b, h, q, d = q_BHQD.shape
    g, t = k_BGTD.shape[1], k_BGTD.shape[2]
    assert d in (16, 32, 64, 128, 256) and h % g == 0, (d, h, g)
    assert q_BHQD.stride(-1) == 1 and k_BGTD.stride(-1) == 1 and v_BGTD.stride(-1) == 1, "head dim must be contiguous"
    out = torch.zeros_like(q_BHQD)
    qstart, qlen = query_spans(qpos_BQ)
    cfg = cfg or PREFILL_CONFIG
    _bi_attention_kernel[attention_grid(b, h, q, cfg["BLOCK_M"])](
        q_BHQD, k_BGTD, v_BGTD, out, qstart, qlen,
        q_BHQD.stride(0), q_BHQD.stride(1), q_BHQD.stride(2), k_BGTD.stride(0), k_BGTD.stride(1), k_BGTD.stride(2),
        v_BGTD.stride(0), v_BGTD.stride(1), v_BGTD.stride(2), out.stride(0), out.stride(1), out.stride(2),
        h, g, t, d ** -0.5 if scale is None else scale, D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=key_block(d),
        UPCAST=INTERPRET, IEEE=q_BHQD.dtype == torch.float32, HEAVY_FIRST=cfg.get("HEAVY_FIRST", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def sdpa_reference(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale: float | None = None):
    mask = torch.arange(k_BGTD.shape[2], device=qpos_BQ.device)[None, None, :] <= qpos_BQ[:, :, None]
    return F.scaled_dot_product_attention(q_BHQD, k_BGTD, v_BGTD, attn_mask=mask[:, None],
                                          enable_gqa=q_BHQD.shape[1] != k_BGTD.shape[1], scale=scale)


class BiAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qpos, scale):
        ctx.save_for_backward(q, k, v, qpos)
        ctx.scale = scale
        return attention_fwd(q, k, v, qpos, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, qpos = ctx.saved_tensors
        with torch.enable_grad():
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            out = sdpa_reference(qr, kr, vr, qpos, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qr, kr, vr), grad)
        return gq, gk, gv, None, None


KERNEL_DIMS = (16, 32, 64, 128, 256)


def bi_attention(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale: float | None = None) -> torch.Tensor:
    """The kernel for any head dims up to 256: q/k of D and v of Dv (MLA: 192 and 128) are zero-padded
    to the next kernel width (zeros add exact zeros to every dot product and output column), the output
    sliced back; the softmax scale stays 1/sqrt(D) unless given."""
    d, dv = q_BHQD.shape[-1], v_BGTD.shape[-1]
    width = next((w for w in KERNEL_DIMS if w >= max(d, dv)), None)
    assert width is not None, f"head dims {d} / {dv} exceed the kernel's {KERNEL_DIMS[-1]}"
    scale = d ** -0.5 if scale is None else scale
    if width == d == dv:
        return BiAttention.apply(q_BHQD, k_BGTD, v_BGTD, qpos_BQ, scale)
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q_BHQD, k_BGTD, v_BGTD))
    return BiAttention.apply(q, k, v, qpos_BQ, scale)[..., :dv]
