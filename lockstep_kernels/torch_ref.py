"""Batch-invariant torch paths (CPU, and the reference the Triton kernels are tested against).

Why each is invariant, measured on x86 CPUs with torch 2.13 (tests/test_kernels.py re-checks it):
  - GEMM: torch's CPU matmul takes a GEMV path for 1-3 rows, whose reduction order differs; the
    matmul here always runs fixed [ROW_TILE, K] x [K, N] tiles through bmm, so every row sees the same
    kernel and the same K order.
  - silu/sigmoid: vectorised and scalar-tail code give different last bits; exp, division and
    multiplication are position-invariant, so silu(x) = x / (1 + exp(-x)).
  - attention: keys are reduced in fixed blocks of KEY_BLOCK aligned to absolute position 0, in order;
    masked keys contribute exact zeros, so a query sees the same sums whether the cache holds 5 keys
    or the packed training sequence holds 500.
  - row reductions over the last dim (RMSNorm mean, log-softmax max/sum) are already row-invariant.
Legend: M rows, K in-features, N out-features, B batch, H query heads, G kv heads, Q queries, T keys, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16
KEY_BLOCK = 16


def linear(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    x_MK = x.reshape(-1, shape[-1])
    m, k = x_MK.shape
    if m == 0:
        return x.new_zeros(*shape[:-1], w_NK.shape[0]) + (0 if b_N is None else b_N)
    tiles = (m + ROW_TILE - 1) // ROW_TILE
    if tiles * ROW_TILE != m:
        x_MK = F.pad(x_MK, (0, 0, 0, tiles * ROW_TILE - m))
    out = torch.bmm(x_MK.view(tiles, ROW_TILE, k), w_NK.t().unsqueeze(0).expand(tiles, k, w_NK.shape[0]))
    out = out.reshape(tiles * ROW_TILE, -1)[:m]
    if b_N is not None:
        out = out + b_N
    return out.reshape(*shape[:-1], w_NK.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    m = x.amax(-1, keepdim=True)
    z = x - m
    return z - torch.log(torch.exp(z).sum(-1, keepdim=True))


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_softmax(x))


def attention(q_BHQD: torch.Tensor, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, qpos_BQ: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over keys 0..qpos (scale 1/sqrt(D) unless given; v may have its own head
    dim), with keys reduced in fixed, position-aligned blocks."""
    b, h, q, d = q_BHQD.shape
    g, t, dv = k_BGTD.shape[1], k_BGTD.shape[2], v_BGTD.shape[-1]
    rep = h // g
    tp = (t + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
    if tp != t:
        k_BGTD = F.pad(k_BGTD, (0, 0, 0, tp - t))
        v_BGTD = F.pad(v_BGTD, (0, 0, 0, tp - t))
    mask_BQT = torch.arange(tp, device=qpos_BQ.device)[None, None, :] <= qpos_BQ[:, :, None]
    scale = d ** -0.5 if scale is None else scale
    qf = q_BHQD.float().reshape(b, g, rep, q, 1, d) * scale
    kf, vf = k_BGTD.float(), v_BGTD.float()
    mask = mask_BQT[:, None, None]  # [B,1,1,Q,T]
    blocks = range(0, tp, KEY_BLOCK)
    scores = []
    for s in blocks:
        k_blk = kf[:, :, None, None, s: s + KEY_BLOCK]  # [B,G,1,1,blk,D]
        sc = (qf * k_blk).sum(-1)  # [B,G,rep,Q,blk]
        scores.append(sc.masked_fill(~mask[..., s: s + KEY_BLOCK], float("-inf")))
    m = torch.stack([sc.amax(-1) for sc in scores], 0).amax(0)  # exact, order-free
    denom = torch.zeros_like(m)
    acc = qf.new_zeros(b, g, rep, q, dv)
    for s, sc in zip(blocks, scores):
        p = torch.exp(sc - m[..., None])
        denom = denom + p.sum(-1)
        acc = acc + (p[..., None] * vf[:, :, None, None, s: s + KEY_BLOCK]).sum(-2)
    out = acc / denom[..., None]
    return out.reshape(b, h, q, dv).to(q_BHQD.dtype)
