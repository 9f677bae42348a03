"""Checks of the Triton kernels, runnable two ways:

  TRITON_INTERPRET=1 python tests/triton_checks.py --small   (CPU interpreter; tests/test_kernels_triton.py)
  python tests/triton_checks.py                              (a GPU; bench/gpu_suite.sh runs it)

Each check compares with a torch reference over odd shapes (per-dtype tolerances, relative Frobenius
error vs an fp64 reference) and tests batch invariance bitwise. The `*_2g` checks run each kernel
where element offsets pass 2^31 (real [16384, 151936] logits and the like on a GPU; rows of a lazily
committed buffer on the CPU, see `far`). Prints one JSON line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lockstep_kernels.gpu.offsets import offset64  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def bits(t):
    """The raw bits of a float tensor (torch.equal calls -0.0 and +0.0 equal)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def randint_exact(shape, dtype, seed):
    """Multiples of 1/8 in [-1, 1): a product is a multiple of 1/64, so a K <= 2^16 dot sums exactly in fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randint(-8, 8, shape, generator=g) / 8).to(dtype).to(DEV)


def check_matmul(small):
    from lockstep_kernels.gpu.matmul import bi_linear

    shapes = [(1, 40, 24), (37, 72, 50), (130, 64, 33)] if small else [(1, 4096, 4096), (77, 896, 4864), (1000, 4096, 1024), (4096, 1024, 4096)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in shapes:
            x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
            y = bi_linear(x, w, b)
            err = rel(y, F.linear(x.double(), w.double(), b.double()))
            assert err < TOL[dtype], (dtype, m, k, n, err)
            for sub in (1, 2, 5, 16, 17):
                if sub <= m:
                    assert torch.equal(bi_linear(x[:sub], w, b), y[:sub]), ("not batch-invariant", dtype, m, sub)
            if DEV == "cuda":  # a row's place in its tile must not matter either (numpy's BLAS, behind
                # the CPU interpreter's tl.dot, does not promise that; the GPU's MMA is what runs for real)
                perm = torch.randperm(m, device=DEV)
                assert torch.equal(bi_linear(x[perm], w, b), y[perm]), ("row position changed the result", dtype, m)
            out[f"{dtype}-{m}x{k}x{n}"] = err
    x = randn(20, 48)
    w = randn(24, 48)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    bi_linear(xr, wr).square().sum().backward()
    xr2, wr2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr2, wr2).square().sum().backward()
    assert rel(xr.grad, xr2.grad) < 1e-4 and rel(wr.grad, wr2.grad) < 1e-4
    return out


def check_matmul_tilings(small):
    """bi_linear at M from 1 to 4096 rows gives every row the bits it gets in a 4096-row product,
    whichever tiling tilings.py picks for each M and weight shape (GPU shapes of the 1.7B and 4B presets,
    all in its per-shape table on Hopper; on a GPU without tables, one tiling, and this is check_matmul at
    more sizes), and the tiling of an unlisted shape comes from the every-shape table."""
    from lockstep_kernels.gpu.matmul import bi_linear, tiling
    from lockstep_kernels.gpu.tilings import SHAPE_TILINGS, TILINGS

    cap = torch.cuda.get_device_capability() if DEV == "cuda" else None
    shapes = [(40, 24)] if small else [(2048, 4096), (2560, 19456), (9728, 2560), (2048, 151936), (1000, 3000)]
    ms = (1, 3, 16, 17, 64, 100) if small else (1, 3, 8, 16, 17, 33, 64, 100, 256, 1000, 2048)
    full_m = 128 if small else 4096
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "kernel")
    out = {"table_entries": len(TILINGS.get(cap, {}).get(torch.bfloat16, [])),
           "shape_tables": len(SHAPE_TILINGS.get(cap, {}).get(torch.bfloat16, {}))}
    for k, n in shapes:
        out[f"tilings {k}x{n}"] = {str(m): [tiling(m, torch.bfloat16, cap, n, k).get(key, "tiles") for key in keys]
                                   for m in ms}
        x, w = randn(full_m, k, dtype=torch.bfloat16, seed=1), randn(n, k, dtype=torch.bfloat16, seed=2) * k ** -0.5
        y = bi_linear(x, w)
        g = torch.Generator(device="cpu").manual_seed(k + n)
        for m in ms:
            rows = torch.randperm(full_m, generator=g)[:m].to(DEV)  # any rows, in any order
            assert torch.equal(bi_linear(x[rows], w), y[rows]), ("rows differ at", m, k, n)
        out[f"{k}x{n}"] = 0.0
        del x, w, y
    return out


def check_matmul_split(small):
    """The fixed split-K (matmul.K_CHUNK): with the chunks in one program (large M) and with one program
    per chunk plus the ordered sum (small M), every row gets the same bits, bias included; rows stay
    batch-invariant across M on either path; the grouped expert kernel splits alike (its rows equal
    bi_matmul's); the result stays a matmul (relative error against fp64); and a K within one chunk
    gives the bits of the unsplit reduction."""
    from lockstep_kernels.gpu import matmul
    from lockstep_kernels.gpu.grouped_matmul import bi_grouped_linear

    chunk = 64 if small else 512
    shapes = [(40, 200, 24), (33, 130, 72)] if small else [(64, 2048, 2048), (256, 4096, 1024), (130, 9728, 2560)]
    saved = dict(matmul.K_CHUNK), matmul.SPLIT_BELOW_SM_FRACTION
    out = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            matmul.K_CHUNK[dtype] = chunk
            for m, k, n in shapes:
                x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
                matmul.SPLIT_BELOW_SM_FRACTION = 0.0  # every chunk in one program
                one = matmul.bi_linear(x, w, b)
                matmul.SPLIT_BELOW_SM_FRACTION = 1e9  # one program per chunk, then the ordered sum
                split = matmul.bi_linear(x, w, b)
                assert torch.equal(bits(one), bits(split)), ("split paths differ", dtype, m, k, n)
                for sub in (1, 3, 17):
                    assert torch.equal(bits(matmul.bi_linear(x[:sub], w, b)), bits(one[:sub])), ("rows", dtype, sub)
                matmul.SPLIT_BELOW_SM_FRACTION = 0.0
                for sub in (1, 3, 17):
                    assert torch.equal(bits(matmul.bi_linear(x[:sub], w, b)), bits(one[:sub])), ("rows", dtype, sub)
                err = rel(one, F.linear(x.double(), w.double(), b.double()))
                assert err < TOL[dtype], (dtype, m, k, n, err)
                out[f"{dtype}-{m}x{k}x{n}"] = err
                # the grouped expert kernel: two experts' rows, each bitwise bi_matmul's
                w2 = torch.stack([w, w.flip(0)])
                offsets = torch.tensor([0, m // 3, m], dtype=torch.int32, device=DEV)
                y = bi_grouped_linear(x, w2, offsets)
                for e, (lo, hi) in enumerate(((0, m // 3), (m // 3, m))):
                    assert torch.equal(bits(y[lo:hi]), bits(matmul.bi_matmul(x[lo:hi].contiguous(), w2[e].t()))), \
                        ("grouped rows differ from bi_matmul under K_CHUNK", dtype, e)
        # The defined order, in fp32: the split product is 0 + part_0 + part_1 + part_2, each part the unsplit
        # reduction of its chunk (fp32 outputs round nothing).
        x, w = randn(9, 3 * chunk - 5, seed=4), randn(24, 3 * chunk - 5, seed=5)
        split = matmul.bi_linear(x, w)
        matmul.K_CHUNK[torch.float32] = None
        total = torch.zeros(9, 24, device=DEV)
        for lo in range(0, x.shape[1], chunk):
            total = total + matmul.bi_linear(x[:, lo: lo + chunk].contiguous(), w[:, lo: lo + chunk].contiguous())
        assert torch.equal(bits(split), bits(total)), "the split is not the ordered sum of the chunks' products"
        assert not torch.equal(bits(split), bits(matmul.bi_linear(x, w))) or small, "the split changed nothing"
    finally:
        matmul.K_CHUNK.clear()
        matmul.K_CHUNK.update(saved[0])
        matmul.SPLIT_BELOW_SM_FRACTION = saved[1]
    return out


def check_matmul_tma(small):
    """The persistent TMA matmul (matmul_tma.py) against matmul.py's kernel with the same tiling: every
    output bitwise equal, bias included, at odd M, N and K (the TMA unit's zero fill past the edges) and
    with fewer programs than tiles (each program walks several); and a matmul (relative error against
    fp64). bi_matmul with a tiling naming the "tma" kernel (a tilings.py row) gives the same bits whether
    it launches the TMA kernel (operands TMA can describe) or falls back to matmul.py's (a view 2 bytes
    off 16-byte alignment; the interpreter)."""
    from lockstep_kernels.gpu.matmul import CONFIGS, bi_matmul
    from lockstep_kernels.gpu.matmul_tma import bi_matmul_tma, tma_ready

    if DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        return {"skipped": "TMA needs compute capability 9.0+"}
    shapes = [(37, 72, 50), (130, 64, 40)] if small else [(1, 2048, 2048), (77, 2560, 9728), (4096, 2048, 6144),
                                                          (16384, 2048, 4096), (1000, 2048, 151936)]
    tilings = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)] if small else [
        dict(CONFIGS[torch.bfloat16]), dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)]
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in shapes:
            if INTERPRETED:  # numpy's BLAS orders a tile's dot by the operands' layout (w^T here, a [K, N]
                # load there) and the CPU: values whose fp32 sums are exact in any order leave the bits to
                # what the interpreter can check (tile walk, zero fill past the edges, bias, epilogue)
                x, w, b = (randint_exact(shape, dtype, seed) for shape, seed in (((m, k), 1), ((n, k), 2), ((n,), 3)))
            else:
                x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2) * k ** -0.5, randn(n, dtype=dtype, seed=3)
            for cfg in tilings:
                cfg = dict(CONFIGS[dtype], **cfg)
                ref = bi_matmul(x, w.t(), b, cfg=cfg)  # matmul.py's kernel with this tiling
                for sms in ((3, None) if small else (None, 7)):
                    y = bi_matmul_tma(x, w, b, cfg=cfg, num_sms=sms)
                    assert torch.equal(bits(y), bits(ref)), ("TMA bits differ", dtype, m, k, n, cfg, sms)
                tma_cfg = dict(cfg, kernel="tma")
                assert tma_ready(x, w) == (DEV == "cuda"), "contiguous GPU operands are TMA-ready"
                assert torch.equal(bits(bi_matmul(x, w.t(), b, cfg=tma_cfg)), bits(ref)), ("tma row", dtype, m, k, n)
                wide = torch.cat([x.new_zeros(m, 1), x], dim=1)[:, 1:]  # x's values, rows 2 bytes off alignment
                assert not tma_ready(wide, w)
                assert torch.equal(bits(bi_matmul(wide, w.t(), b, cfg=tma_cfg)), bits(ref)), ("fallback", dtype, m, k, n)
            out[f"{dtype}-{m}x{k}x{n}"] = rel(y, F.linear(x.double(), w.double(), b.double()))
            assert out[f"{dtype}-{m}x{k}x{n}"] < TOL[torch.bfloat16], out
            del x, w, b
    return out


def check_grouped_matmul(small):
    """The grouped expert GEMM: each expert's rows bitwise what bi_matmul computes for them alone (the
    true on-policy trainer's per-expert call), for uneven counts with experts of no rows, tiles past
    BLOCK_M, and expert weights at a step as in the engine's flat buffer; and the engine's stacked
    experts path (run_experts_stacked) bitwise the per-expert loop in batch-invariant mode."""
    import lockstep_kernels as kernels
    from lockstep_kernels.gpu.grouped_matmul import bi_grouped_linear
    from lockstep_kernels.gpu.matmul import bi_matmul
    from pipeline.models.layers import MLP, Experts, run_experts_loop, run_experts_stacked

    e, n, k = (6, 40, 72) if small else (16, 768, 2048)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for counts in ([3, 0, 70, 1, 0, 131], [0, 0, 0, 0, 0, 2], [1, 1, 1, 1, 1, 1]):
            counts = (counts * -(-e // len(counts)))[:e]
            a = sum(counts)
            x = randn(a, k, dtype=dtype, seed=1)
            w_flat = randn(e * 3 * n * k, dtype=dtype, seed=2)  # expert i's weight at i * 3nk, as flattened
            w = w_flat.as_strided((e, n, k), (3 * n * k, k, 1), n * k)
            offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
            y = bi_grouped_linear(x, w, offsets)
            lo = 0
            for i, c in enumerate(counts):
                alone = bi_matmul(x[lo: lo + c].contiguous(), w[i].t())
                assert torch.equal(y[lo: lo + c], alone), ("expert rows differ from bi_matmul", dtype, counts, i)
                lo += c
            err = rel(y, torch.cat([x[o: o + c].double() @ w[i].double().t()
                                    for i, (o, c) in enumerate(zip(offsets.tolist(), counts))]))
            assert err < TOL[dtype], (dtype, counts, err)
            out[f"{dtype}-{a}rows"] = err
    d, i_size, experts_n = (24, 40, 7) if small else (2048, 768, 128)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        experts = Experts(MLP(d, i_size) for _ in range(experts_n)).to(device=DEV, dtype=dtype)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.05)
        assert experts.stack(cpu=True)
        for tokens in ((1, 5, 37) if small else (1, 8, 64, 512)):
            x = randn(tokens, d, dtype=dtype, seed=tokens)
            idx = torch.rand(tokens, experts_n, device=DEV).topk(4, dim=-1).indices
            w_Nk = torch.rand(tokens, 4, device=DEV).to(dtype)
            with torch.no_grad(), kernels.batch_invariant_mode():
                loop = run_experts_loop(experts, x, idx, w_Nk)
                fast = run_experts_stacked(experts.stacked, x, idx, w_Nk)
            assert torch.equal(fast, loop), ("stacked experts path != loop", dtype, tokens)
    return out


def check_rms_norm(small):
    from lockstep_kernels.gpu.rms_norm import bi_rms_norm
    from lockstep_kernels.torch_ref import rms_norm

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in ((16, 60) if small else (128, 896, 4096, 5120)):
            x, w = randn(33, n, dtype=dtype) * 3, randn(n, dtype=dtype)
            y = bi_rms_norm(x, w, 1e-6)
            err = rel(y, rms_norm(x.double(), w.double(), 1e-6))
            assert err < TOL[dtype], (dtype, n, err)
            assert torch.equal(bi_rms_norm(x[:1], w, 1e-6), y[:1]) and torch.equal(bi_rms_norm(x[:7], w, 1e-6), y[:7])
            out[f"{dtype}-{n}"] = err
    return out


def check_log_softmax(small):
    from lockstep_kernels.gpu.log_softmax import bi_log_softmax, bi_token_logprob

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for v in ((50, 300) if small else (1000, 32000, 151936)):
            x = randn(19, v, dtype=dtype) * 4
            y = bi_log_softmax(x)
            ref = torch.log_softmax(x.double(), -1)
            err = rel(y, ref)
            assert err < 1e-5, (dtype, v, err)
            assert torch.equal(bi_log_softmax(x[:1]), y[:1])
            t = torch.randint(0, v, (19,), device=DEV)
            for temp in (1.0, 0.7):
                lp = bi_token_logprob(x, t, temp)
                ref_lp = torch.log_softmax(x.double() / temp, -1).gather(-1, t[:, None]).squeeze(-1)
                assert rel(lp, ref_lp) < 1e-5, (dtype, v, temp)
                assert torch.equal(bi_token_logprob(x[:3], t[:3], temp), lp[:3])
            xr = x.float().clone().requires_grad_()
            (bi_token_logprob(xr, t, 0.7) * torch.arange(19, device=DEV)).sum().backward()
            xr2 = x.float().clone().requires_grad_()
            (torch.log_softmax(xr2 / 0.7, -1).gather(-1, t[:, None]).squeeze(-1) * torch.arange(19, device=DEV)).sum().backward()
            assert rel(xr.grad, xr2.grad) < 1e-5
            out[f"{dtype}-{v}"] = err
    return out


def check_attention_configs(small):
    """The prefill kernel under other launch configurations (query rows per program, warps, stages, the
    heavy-first tile order or not):
    every output bitwise the pinned configuration's (attention.PREFILL_CONFIG), including queries whose
    tile starts mid-sequence (a span that does not start at 0) and a 64-row decode of the same queries."""
    from lockstep_kernels.gpu.attention import PREFILL_CONFIG, attention_fwd

    configs = [dict(BLOCK_M=128, num_warps=8, num_stages=2), dict(BLOCK_M=64, num_warps=4, num_stages=3),
               dict(BLOCK_M=128, num_warps=4, num_stages=3), dict(BLOCK_M=64, num_warps=8, num_stages=1),
               dict(PREFILL_CONFIG, HEAVY_FIRST=False), dict(PREFILL_CONFIG, HEAVY_FIRST=True),
               dict(BLOCK_M=128, num_warps=8, num_stages=2, HEAVY_FIRST=True)]
    cases = [(2, 4, 2, 16, 150)] if small else [(4, 16, 8, 128, 1100), (2, 32, 8, 128, 2048), (3, 14, 2, 64, 700)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, g, d, t in cases:
            q, k, v = randn(b, h, t, d, dtype=dtype, seed=1), randn(b, g, t, d, dtype=dtype, seed=2), randn(b, g, t, d, dtype=dtype, seed=3)
            qpos = torch.arange(t, device=DEV)[None].expand(b, t).contiguous()
            ref = attention_fwd(q, k, v, qpos, cfg=PREFILL_CONFIG)
            tail = t // 3  # queries t//3.. over the whole cache: tiles that start mid-sequence
            ref_tail = attention_fwd(q[:, :, tail:].contiguous(), k, v, qpos[:, tail:].contiguous(), cfg=PREFILL_CONFIG)
            for cfg in configs:
                full = attention_fwd(q, k, v, qpos, cfg=cfg)
                tail_out = attention_fwd(q[:, :, tail:].contiguous(), k, v, qpos[:, tail:].contiguous(), cfg=cfg)
                if INTERPRETED and cfg["BLOCK_M"] != PREFILL_CONFIG["BLOCK_M"]:  # numpy's BLAS: other tile
                    assert rel(full, ref) < TOL[dtype] and rel(tail_out, ref_tail) < TOL[dtype], (dtype, cfg)  # rows
                    continue
                assert torch.equal(bits(full), bits(ref)), ("prefill", dtype, cfg)
                assert torch.equal(bits(tail_out), bits(ref_tail)), ("mid-sequence span", dtype, cfg)
            if not INTERPRETED:  # a row's place in a tile: the GPU's MMAs only (see bi_decode)
                assert torch.equal(bits(ref_tail), bits(ref[:, :, tail:])), ("span start changed bits", dtype)
            out[f"{dtype}-b{b}h{h}g{g}d{d}t{t}"] = 0.0
    return out


def check_attention(small):
    from lockstep_kernels.gpu.attention import bi_attention, sdpa_reference

    out = {}
    cases = [(2, 4, 2, 16, 21)] if small else [(4, 16, 2, 64, 300), (2, 14, 2, 64, 1100), (1, 32, 8, 128, 2048)]
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, g, d, t in cases:
            q, k, v = randn(b, h, t, d, dtype=dtype, seed=1), randn(b, g, t, d, dtype=dtype, seed=2), randn(b, g, t, d, dtype=dtype, seed=3)
            qpos = torch.arange(t, device=DEV)[None].expand(b, t).contiguous()
            o = bi_attention(q, k, v, qpos)
            err = rel(o, sdpa_reference(q.double(), k.double(), v.double(), qpos))
            assert err < TOL[dtype] * 2, (dtype, b, h, g, d, t, err)
            # Decode: each position as one query over a cache holding exactly its prefix, or more.
            for p in sorted({0, 1, t // 3, t - 2, t - 1}):
                one = bi_attention(q[:, :, p: p + 1].contiguous(), k[:, :, : p + 1], v[:, :, : p + 1], torch.full((b, 1), p, device=DEV))
                assert torch.equal(one, o[:, :, p: p + 1]), ("decode != prefill", dtype, p)
                full = bi_attention(q[:, :, p: p + 1].contiguous(), k, v, torch.full((b, 1), p, device=DEV))
                assert torch.equal(full, o[:, :, p: p + 1]), ("cache length changed the result", dtype, p)
            assert torch.equal(bi_attention(q[:1], k[:1], v[:1], qpos[:1]), o[:1]), "batch composition changed the result"
            out[f"{dtype}-b{b}h{h}g{g}d{d}t{t}"] = err
    # MLA (DeepSeek-V3): q / k head dim 192 and v 128 at real size (24 / 16 small), padded to the kernel's
    # next width; a softmax scale of its own (YaRN's mscale)
    mla = [(2, 4, 4, 24, 16, 21)] if small else [(1, 16, 16, 192, 128, 300)]
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, g, d, dv, t in mla:
            q, k, v = randn(b, h, t, d, dtype=dtype, seed=7), randn(b, g, t, d, dtype=dtype, seed=8), randn(b, g, t, dv, dtype=dtype, seed=9)
            qpos = torch.arange(t, device=DEV)[None].expand(b, t).contiguous()
            scale = 1.37 * d ** -0.5
            o = bi_attention(q, k, v, qpos, scale)
            assert o.shape == (b, h, t, dv)
            err = rel(o, sdpa_reference(q.double(), k.double(), v.double(), qpos, scale))
            assert err < TOL[dtype] * 2, ("mla", dtype, d, dv, err)
            for p in sorted({0, t // 2, t - 1}):
                one = bi_attention(q[:, :, p: p + 1].contiguous(), k[:, :, : p + 1], v[:, :, : p + 1], torch.full((b, 1), p, device=DEV), scale)
                assert torch.equal(one, o[:, :, p: p + 1]), ("mla decode != prefill", dtype, p)
            assert torch.equal(bi_attention(q[:1], k[:1], v[:1], qpos[:1], scale), o[:1]), "mla batch composition"
            out[f"mla-{dtype}-d{d}dv{dv}t{t}"] = err
    q, k, v = (randn(1, 4, 9, 16, seed=s).requires_grad_() for s in (4, 5, 6))
    qpos = torch.arange(9, device=DEV)[None]
    bi_attention(q, k, v, qpos).sum().backward()
    assert q.grad is not None and torch.isfinite(k.grad).all()
    q, k, v = randn(1, 4, 9, 24, seed=4).requires_grad_(), randn(1, 4, 9, 24, seed=5).requires_grad_(), randn(1, 4, 9, 16, seed=6).requires_grad_()
    bi_attention(q, k, v, qpos, 0.3).sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape and torch.isfinite(k.grad).all()
    return out


def check_decode_attention(small):
    """The split-key decode kernel vs an fp64 reference: several sequences of different lengths in a
    longer cache with more slots than sequences, forced split counts (one, some empty, many)."""
    from lockstep_kernels.gpu.decode_attention import decode_attention_fwd

    out = {}
    cases = [(3, 4, 2, 16, 150, [1, 70, 150])] if small else [(5, 14, 2, 64, 1100, [1, 63, 64, 65, 1100]),
                                                           (3, 32, 8, 128, 2048, [2048, 7, 1000]), (1, 16, 16, 64, 300, [300])]
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, g, d, t, lens in cases:
            q = randn(b, h, d, dtype=dtype, seed=1)
            k, v = randn(b + 2, g, t, d, dtype=dtype, seed=2), randn(b + 2, g, t, d, dtype=dtype, seed=3)
            lens_B = torch.tensor(lens, device=DEV)
            mask = (torch.arange(t, device=DEV)[None, :] < lens_B[:, None])[:, None, None]
            ref = F.scaled_dot_product_attention(q.double()[:, :, None], k[:b].double(), v[:b].double(), attn_mask=mask,
                                                 enable_gqa=h != g)[:, :, 0]
            for splits in (None, 1, 3, 40):
                o = decode_attention_fwd(q, k, v, lens_B, splits=splits)
                err = rel(o, ref)
                assert err < TOL[dtype] * 2, (dtype, b, h, g, d, t, splits, err)
                out[f"{dtype}-b{b}h{h}g{g}d{d}t{t}-p{splits}"] = err
    return out


def check_bi_decode(small):
    """The batch-invariant decode (one query per sequence, the group's heads as rows) vs the batch-
    invariant attention kernel's prefill of each whole sequence: the decode query's output equals the
    prefill's row at that position bitwise, at several batch sizes, lengths and GQA groups, in a cache
    with more slots and positions than the sequences use. On a GPU only: the interpreter's tl.dot is
    numpy's, whose bits for a row depend on its row in the tile (OpenBLAS's 6-row micro-kernel), and the
    decode tile holds a query at the row of its head, the prefill tile at the row of its position."""
    import lockstep_kernels as kernels
    from lockstep_kernels.gpu.attention import bi_attention
    from lockstep_kernels.gpu.decode_attention import bi_decode_attention
    from pipeline.models.attention import PackedCausal

    def pack(x_BXTD, lens):  # [B, X, T, D] -> the sequences' first lens[b] positions back to back, [N, X, D]
        return torch.cat([x_BXTD[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])

    out = {}
    cases = [(3, 4, 2, 16, 150, [1, 70, 150]), (2, 7, 1, 32, 80, [65, 3])] if small else [
        (5, 14, 2, 64, 1100, [1, 63, 64, 65, 1100]), (3, 32, 8, 128, 2048, [2048, 7, 1000]),
        (4, 16, 8, 128, 700, [700, 1, 129, 512]), (2, 16, 16, 64, 300, [300, 5]), (2, 8, 1, 256, 200, [200, 33])]
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, g, d, t, lens in cases:
            k, v = randn(b + 2, g, t + 7, d, dtype=dtype, seed=2), randn(b + 2, g, t + 7, d, dtype=dtype, seed=3)
            q_full = randn(b, h, t, d, dtype=dtype, seed=1)  # every position's query; decode takes lens[b] - 1's
            lens_B = torch.tensor(lens, device=DEV)
            qpos = torch.arange(t, device=DEV)[None].expand(b, t).contiguous()
            prefill = bi_attention(q_full, k[:b, :, :t], v[:b, :, :t], qpos)
            last = lens_B - 1
            q_dec = q_full[torch.arange(b, device=DEV), :, last].contiguous()
            dec = bi_decode_attention(q_dec, k, v, lens_B)
            want = prefill[torch.arange(b, device=DEV), :, last]
            # the trainer's own path: packed sequences through PackedCausal's padded grid (other strides)
            ctx = PackedCausal.from_lengths(lens, device=DEV, varlen=False)
            with kernels.batch_invariant_mode():
                o_pack = ctx.attend(0, pack(q_full, lens), pack(k[:b], lens), pack(v[:b], lens))  # [tokens, H, D]
            ends = torch.tensor(lens, device=DEV).cumsum(0) - 1
            trained = o_pack[ends]
            assert torch.equal(bits(trained), bits(want)), (dtype, b, h, g, d, t, "packed vs grid prefill")
            if INTERPRETED:  # numpy's matmul gives a row different bits at different row positions of a tile
                assert rel(dec, want) < TOL[dtype], (dtype, b, h, g, d, t, rel(dec, want))
            else:
                assert torch.equal(bits(dec), bits(want)), (dtype, b, h, g, d, t,
                                                            float((dec.double() - want.double()).abs().max()))
                assert torch.equal(bits(dec), bits(trained)), (dtype, b, h, g, d, t, "vs the trainer's packed path")
            # and a single sequence decoded alone gets the same bits as in the batch
            one = bi_decode_attention(q_dec[1:2].contiguous(), k[1:2], v[1:2], lens_B[1:2])
            assert torch.equal(bits(one), bits(dec[1:2])), (dtype, b, h, g, d, t, "alone")
            out[f"{dtype}-b{b}h{h}g{g}d{d}t{t}"] = 0.0
    return out


def check_fp8_matmul(small):
    """The W8A8 block-scaled GEMM: activation quantisation bit-equal to the torch reference, the GEMM
    equal to the reference's (dequantise, fp32 matmul) up to fp32 sum order, split-K and not, and
    within FP8's error of the exact product."""
    from lockstep_kernels import fp8
    from lockstep_kernels.gpu.fp8_matmul import fp8_linear, quantize_act

    out = {}
    shapes = [(1, 200, 72), (5, 256, 130), (40, 130, 64), (3, 64, 40)] if small else [(1, 896, 4864), (16, 4864, 896), (64, 896, 1152),
                                                                       (256, 2048, 6144), (1000, 1024, 4096)]
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in shapes:
            x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2) * 0.05, randn(n, dtype=dtype, seed=3)
            q_w, s_w = fp8.quantize(w)
            if DEV == "cuda":  # the CPU interpreter mis-rounds e4m3 casts that carry (lockstep_kernels/gpu/fp8_matmul.py)
                qa, sa = quantize_act(x)
                rqa, rsa = fp8.quantize_act_ref(x)
                assert torch.equal(sa, rsa) and torch.equal(qa.view(torch.uint8), rqa.view(torch.uint8)), ("act quant", m, k)
            for bias in (None, b):
                y = fp8_linear(x, q_w, s_w, bias)
                ref = fp8.linear_ref(x, q_w, s_w, bias)
                err = rel(y, ref)
                # Hopper's FP8 MMA adds the products of a k-block in less than fp32 precision (why
                # DeepSeek-V3 promotes to fp32 every 128 elements, as this kernel does): ~1e-4 there.
                tol = max(TOL[dtype] * 2, 1e-3 if DEV == "cuda" else 0.0)
                assert y.dtype == dtype and err < tol, (dtype, m, k, n, err)
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                assert rel(y, exact) < 0.08, ("beyond FP8 error", dtype, m, k, n, rel(y, exact))
            out[f"{dtype}-{m}x{k}x{n}"] = err
    return out


def check_sampling(small):
    """The fused Gumbel-max sampler picks exactly the torch path's tokens (same noise, same argmax),
    greedy rows included, for rows of different seeds, positions and temperatures."""
    from lockstep_kernels.gpu.sampling import gumbel_argmax
    from pipeline.models.logprobs import GREEDY_EPS
    from pipeline.rollout.engine import sampling

    out = {}
    shapes = [(5, 3000), (1, 9000)] if small else [(1, 151936), (64, 151936), (256, 151936)]
    for dtype in (torch.float32, torch.bfloat16):
        for b, v in shapes:
            logits = randn(b, v, dtype=dtype, seed=4) * 3
            temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * b, device=DEV)[:b]
            seeds = torch.arange(b, device=DEV, dtype=torch.int64) * 7919 + 12345
            pos = torch.arange(b, device=DEV, dtype=torch.int64) * 3 + 1
            want = sampling.sample(logits, temp, torch.ones(b, device=DEV), torch.full((b,), -1, device=DEV), seeds, pos) \
                if not sampling.use_triton(logits) else None
            if want is None:  # on a GPU sample() itself takes the kernel: compare with its torch body
                scaled = sampling.scaled_logits(logits, temp)
                g = -torch.log(-torch.log(sampling.hash_uniform(seeds, pos, v)))
                want = torch.where((temp < GREEDY_EPS)[:, None], scaled.double(), scaled.double() + g).argmax(-1)
            got = gumbel_argmax(logits, temp, seeds, pos, GREEDY_EPS)
            assert torch.equal(got, want), (dtype, b, v, got.tolist()[:8], want.tolist()[:8])
            out[f"{dtype}-{b}x{v}"] = 0.0
    return out


def check_varlen_attention(small):
    """Training attention on GPUs (packed sequences through flash attention's varlen kernel) against
    the padded-grid SDPA path, forward and gradients, bf16, GQA."""
    from pipeline.models.attention import PackedCausal
    import lockstep_kernels as kernels

    if DEV != "cuda":
        return {"skipped": "needs a GPU"}
    lengths = [5, 300, 1, 77, 1024] if not small else [5, 3]
    ctx = PackedCausal.from_lengths(lengths, device=DEV)
    n = sum(lengths)
    out = {}
    for h, g in ((14, 2), (8, 8)):
        q, k, v = (randn(n, c, 64, dtype=torch.bfloat16, seed=s).requires_grad_() for s, c in ((1, h), (2, g), (3, g)))
        assert kernels.packed_causal_attention(q, k, v, ctx.cu_seqlens.int(), ctx.max_len) is not None
        o = ctx.attend(0, q, k, v)
        grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
        grid = lambda x: ctx.to_grid(x).transpose(1, 2)  # noqa: E731
        ref = kernels.attention(grid(q), grid(k), grid(v), ctx.qpos_BT).transpose(1, 2)[ctx.grid_index]
        ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        out[f"h{h}g{g}-out"] = rel(o, ref)
        assert out[f"h{h}g{g}-out"] < 1e-2, out
        for name, a, b in zip("qkv", grads, ref_grads):
            out[f"h{h}g{g}-d{name}"] = rel(a, b)
            assert out[f"h{h}g{g}-d{name}"] < 2e-2, out
    return out


# ---- Element offsets past 2^31 (issue 20, lockstep_kernels/gpu/offsets.py) ------------------------
# A kernel that forms `row * row_stride` in int32 reads and writes the wrong place once a row starts
# past 2^31 elements. On a GPU the *_2g checks build tensors that large ([16384, 151936] logits, a
# 72-slot KV cache of 32768 positions; 5-15 GB at a time, freed after each check) and compare the rows
# on both sides of the boundary and the last row with torch. On the CPU (--small) they take views
# whose first dimension steps through one buffer (`far`): rows or slots past 2^31 elements, of which
# only the written pages are ever backed by memory.
ROW_STRIDE = 2**30 + 2**20  # one program per row or slot: row 2 starts at 2^31 + 2^21
TILE_STRIDE = 2**24 + 2**16  # tiles of up to 128 rows: rows 0-127 end below 2^31, row 128 starts past it
BF16 = torch.bfloat16


def past_2g(stride: int) -> int:
    """The first index whose offset index * stride is 2^31 or more."""
    return -(-2**31 // stride)


def boundary(n: int, stride: int) -> list[int]:
    """Indices to compare: the first, both sides of the 2^31 boundary, the last."""
    return sorted({0, past_2g(stride) - 1, past_2g(stride), n - 1})


def far(x: torch.Tensor, stride: int) -> torch.Tensor:
    """x (contiguous) copied into a view whose first dimension steps `stride` elements through one
    larger buffer: its last rows start past 2^31 elements. On the CPU torch.empty leaves the buffer's
    pages uncommitted until written, so the view costs only the memory of its own rows."""
    assert x.is_contiguous() and stride >= x[0].numel() and (x.shape[0] - 1) * stride >= 2**31, (x.shape, stride)
    big = torch.empty((x.shape[0] - 1) * stride + x[0].numel(), dtype=x.dtype, device=x.device)
    view = big.as_strided(x.shape, (stride, *x[0].stride()))
    view.copy_(x)
    return view


def randn_dev(*shape, dtype=BF16, seed=0):
    """randn drawn on DEV itself (`randn` draws on the CPU: minutes for 2^31 elements)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=dtype)


def exact_e4m3(rows, cols, seed=0):
    """Integers in [-8, 8] with 448 opening every 128-column group: FP8 scales of exactly 1 and every
    value exact in e4m3 (the CPU interpreter mis-rounds e4m3 casts that carry, gpu/fp8_matmul.py)."""
    x = torch.randint(-8, 9, (rows, cols), generator=torch.Generator().manual_seed(seed)).to(BF16)
    x[:, ::128] = 448
    return x.to(DEV)


@triton.jit
def _offset_probe_kernel(index_ptr, wide_ptr, narrow_ptr, stride):
    """wide = offset64(index, stride); narrow = index * stride in the index's int32 (the control)."""
    index = tl.load(index_ptr)
    tl.store(wide_ptr, offset64(index, stride))
    tl.store(narrow_ptr, (index * stride).to(tl.int64))


def check_offsets(small):
    """offset64 is the exact product where int32 arithmetic wraps: the last rows of a [16384, 151936]
    LM-head output, the last slot of a 256-slot KV cache, the far rows of the CPU checks. The same
    product in int32 is right below 2^31 and wrong past it (reported as narrow - exact)."""
    out = {}
    for index, stride in [(16383, 151936), (14135, 151936), (14134, 151936), (255, 8 * 32768 * 128),
                          (128, TILE_STRIDE), (2, ROW_STRIDE), (0, 151936), (3, 2**31 + 5)]:
        wide, narrow = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
        _offset_probe_kernel[(1,)](torch.tensor([index], dtype=torch.int32, device=DEV), wide, narrow, stride)
        exact = index * stride
        assert wide.item() == exact, ("offset64", index, stride, wide.item(), exact)
        fits = exact < 2**31 or stride >= 2**31  # Triton passes a stride of 2^31 or more as int64
        assert (narrow.item() == exact) == fits, ("int32 control", index, stride, narrow.item(), exact)
        out[f"{index}x{stride}"] = narrow.item() - exact
    return out


def check_matmul_2g(small):
    """bi_linear where the output, the weight or the input has more than 2^31 elements: rows (columns
    for the weight) around the boundary and the last against an fp32 product, and rows bitwise against
    the same rows computed alone. CPU: input and weight rows 128-129 start past 2^31."""
    from lockstep_kernels.gpu.matmul import bi_linear

    if small:
        x = far(randn(130, 48, dtype=BF16, seed=1), TILE_STRIDE)
        w = far(randn(130, 48, dtype=BF16, seed=2), TILE_STRIDE)
        err = rel(bi_linear(x, w), F.linear(x.double(), w.double()))
        assert err < TOL[BF16], err
        return {"far-rows": err}

    def case(m, k, n, big):
        x, w = randn_dev(m, k, seed=1), randn_dev(n, k, seed=2)
        y = bi_linear(x, w)
        if big == "weight":
            cols = boundary(n, k)
            return rel(y[:, cols], F.linear(x.float(), w[cols].float()))
        rows = boundary(m, n if big == "output" else k)
        assert torch.equal(bi_linear(x[rows], w), y[rows]), ("rows computed alone differ", big)
        return rel(y[rows], F.linear(x[rows].float(), w.float()))

    out = {}
    for big, mkn in {"output": (16384, 1024, 151936), "weight": (64, 16384, 151936), "input": (139264, 16384, 128)}.items():
        out[big] = case(*mkn, big)
        assert out[big] < TOL[BF16], (big, out[big])
    return out


def check_rms_norm_2g(small):
    """bi_rms_norm on rows past 2^31 elements (GPU: 266240 tokens x 8192): the rows around the boundary
    and the last against fp64 torch, and bitwise against the same rows alone."""
    from lockstep_kernels.gpu.rms_norm import bi_rms_norm
    from lockstep_kernels.torch_ref import rms_norm

    if small:
        x, rows = far(randn(3, 60, dtype=BF16, seed=5) * 3, ROW_STRIDE), [0, 1, 2]
    else:
        x = randn_dev(past_2g(8192) + 4096, 8192, seed=5)
        rows = boundary(x.shape[0], 8192)
    w = randn(x.shape[1], dtype=BF16, seed=6)
    y = bi_rms_norm(x, w, 1e-6)
    err = rel(y[rows], rms_norm(x[rows].double(), w.double(), 1e-6))
    assert err < TOL[BF16], err
    assert torch.equal(bi_rms_norm(x[rows], w, 1e-6), y[rows]), "rows computed alone differ"
    return {"rows": err}


def check_log_softmax_2g(small):
    """bi_log_softmax and bi_token_logprob (forward and backward) on [16384, 151936] bf16 logits (CPU:
    row 2 past 2^31): rows around the boundary and the last against fp64 torch, and bitwise against the
    same rows computed alone."""
    from lockstep_kernels.gpu.log_softmax import bi_log_softmax, bi_token_logprob

    if small:
        x, rows = far(randn(3, 300, dtype=BF16, seed=4) * 4, ROW_STRIDE), [0, 1, 2]
    else:
        x, rows = randn_dev(16384, 151936, seed=4).mul_(4), boundary(16384, 151936)
    m, v = x.shape
    temp = 0.7
    t = torch.arange(m, device=x.device) * 7919 % v
    g = torch.arange(m, device=x.device, dtype=torch.float32) / m + 0.5
    x_rows = x[rows]
    out = {}
    y = bi_log_softmax(x)
    out["log_softmax"] = rel(y[rows], torch.log_softmax(x_rows.double(), -1))
    assert out["log_softmax"] < 1e-5 and torch.equal(bi_log_softmax(x_rows), y[rows]), out
    del y
    ref = torch.log_softmax(x_rows.double() * (1 / temp), -1)
    x.requires_grad_()
    lp = bi_token_logprob(x, t, temp)
    out["token_logprob"] = rel(lp.detach()[rows], ref.gather(-1, t[rows, None]).squeeze(-1))
    (dx,) = torch.autograd.grad(lp, x, g)
    onehot = F.one_hot(t[rows], v).double()
    out["token_logprob_grad"] = rel(dx[rows], (onehot - ref.exp()) * (g[rows, None].double() / temp))
    assert out["token_logprob"] < 1e-5 and out["token_logprob_grad"] < TOL[BF16], out
    alone = x_rows.clone().requires_grad_()
    lp_alone = bi_token_logprob(alone, t[rows], temp)
    assert torch.equal(lp_alone, lp[rows]), "token logprobs of rows computed alone differ"
    assert torch.equal(torch.autograd.grad(lp_alone, alone, g[rows])[0], dx[rows]), "gradients of rows alone differ"
    return out


def kv_cache_2g(small):
    """(q, k, v, slots): a KV cache [S, G, T, D] whose later slots start past 2^31 elements and one
    query per slot (CPU: 3 slots, queries and keys far; GPU: 72 slots x 8 kv heads x 32768 x 128,
    4.8 GB each for keys and values, 32 query heads), with the slots to compare."""
    if small:
        b, h, g, t, d = 3, 4, 2, 40, 16
        q = far(randn(b, h, d, dtype=BF16, seed=1), ROW_STRIDE)
        k, v = (far(randn(b, g, t, d, dtype=BF16, seed=s), ROW_STRIDE) for s in (2, 3))
        return q, k, v, [0, 1, 2]
    b, h, g, t, d = 72, 32, 8, 32768, 128
    return randn_dev(b, h, d, seed=1), randn_dev(b, g, t, d, seed=2), randn_dev(b, g, t, d, seed=3), boundary(b, g * t * d)


def check_attention_2g(small):
    """bi_attention (batch-invariant decode reads the cache through it) with slots past 2^31 elements:
    slots around the boundary and the last against fp64 SDPA, and bitwise against those sequences alone."""
    from lockstep_kernels.gpu.attention import bi_attention, sdpa_reference

    q, k, v, slots = kv_cache_2g(small)
    b, t = k.shape[0], k.shape[2]
    q = q[:, :, None]
    qpos = (t - 1 - torch.arange(b, device=k.device) * 7919 % (t // 2))[:, None]
    o = bi_attention(q, k, v, qpos)
    err = rel(o[slots], sdpa_reference(q[slots].double(), k[slots].double(), v[slots].double(), qpos[slots]))
    assert err < TOL[BF16] * 2, err
    assert torch.equal(bi_attention(q[slots], k[slots], v[slots], qpos[slots]), o[slots]), "sequences alone differ"
    return {"slots": err}


def check_decode_attention_2g(small):
    """The split-key decode kernel with cache slots past 2^31 elements: slots around the boundary and
    the last against fp64 SDPA."""
    from lockstep_kernels.gpu.decode_attention import decode_attention_fwd

    q, k, v, slots = kv_cache_2g(small)
    b, h, t = q.shape[0], q.shape[1], k.shape[2]
    lens = t - torch.arange(b, device=k.device) * 7919 % (t // 2)
    o = decode_attention_fwd(q, k, v, lens)
    mask = (torch.arange(t, device=k.device)[None, :] < lens[slots, None])[:, None, None]
    ref = F.scaled_dot_product_attention(q[slots].double()[:, :, None], k[slots].double(), v[slots].double(),
                                         attn_mask=mask, enable_gqa=h != k.shape[1])[:, :, 0]
    err = rel(o[slots], ref)
    assert err < TOL[BF16] * 2, err
    return {"slots": err}


def check_sampling_2g(small):
    """The fused sampler on [16384, 151936] bf16 logits (CPU: row 2 past 2^31): the tokens of the rows
    around the boundary and the last equal the torch path's."""
    from lockstep_kernels.gpu.sampling import gumbel_argmax
    from pipeline.models.logprobs import GREEDY_EPS
    from pipeline.rollout.engine import sampling

    if small:
        logits, rows = far(randn(3, 3000, dtype=BF16, seed=4) * 3, ROW_STRIDE), [0, 1, 2]
    else:
        logits, rows = randn_dev(16384, 151936, seed=4).mul_(3), boundary(16384, 151936)
    b, v = logits.shape
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3], device=logits.device).repeat(b // 4 + 1)[:b]
    seeds = torch.arange(b, device=logits.device) * 7919 + 12345
    pos = torch.arange(b, device=logits.device) * 3 + 1
    got = gumbel_argmax(logits, temp, seeds, pos, GREEDY_EPS)[rows]
    scaled = sampling.scaled_logits(logits[rows], temp[rows]).double()
    noisy = scaled - torch.log(-torch.log(sampling.hash_uniform(seeds[rows], pos[rows], v)))
    want = torch.where((temp[rows] < GREEDY_EPS)[:, None], scaled, noisy).argmax(-1)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    return {"rows": 0.0}


def check_fp8_2g(small):
    """Blockwise FP8 quantisation and dequantisation of a [151936, 16384] weight (GPU) / of 130 rows
    whose second 128-row block starts past 2^31 (CPU): the blocks around the boundary and the last,
    bitwise against the torch reference."""
    from lockstep_kernels import fp8
    from lockstep_kernels.gpu.fp8 import dequantize_blockwise, quantize_blockwise

    if small:
        w, spans = far(exact_e4m3(130, 128, seed=7), TILE_STRIDE), [(0, 130)]
    else:
        n, r = 151936, past_2g(16384)  # 131072: a block boundary
        w, spans = randn_dev(n, 16384, seed=7).mul_(0.05), [(0, 128), (r - 128, r + 128), (n - 128, n)]
    q, s = quantize_blockwise(w)
    back = dequantize_blockwise(far(q, TILE_STRIDE) if small else q, s, BF16)
    for lo, hi in spans:
        rq, rs = fp8.quantize_ref(w[lo:hi])
        assert torch.equal(q[lo:hi].view(torch.uint8), rq.view(torch.uint8)), ("quantised values", lo, hi)
        assert torch.equal(s[lo // 128: -(-hi // 128)], rs), ("scales", lo, hi)
        assert torch.equal(back[lo:hi], fp8.dequantize_ref(rq, rs, BF16)), ("dequantised", lo, hi)
    return {f"{lo}-{hi}": 0.0 for lo, hi in spans}


def check_fp8_matmul_2g(small):
    """fp8_linear (W8A8) where the output, the weight or the activations have more than 2^31 elements
    (GPU): rows (column blocks for the weight) around the boundary and the last against the torch
    reference. CPU: weight rows 128-129 past 2^31, and quantize_act on its own with row 2 past 2^31 (the
    interpreter's fp8_linear quantises activations with the torch reference)."""
    from lockstep_kernels import fp8
    from lockstep_kernels.gpu.fp8_matmul import fp8_linear, quantize_act

    if small:
        x = randn(5, 128, dtype=BF16, seed=1)
        q_w, s_w = fp8.quantize_ref(randn(130, 128, dtype=BF16, seed=2) * 0.05)
        err = rel(fp8_linear(x, far(q_w, TILE_STRIDE), s_w), fp8.linear_ref(x, q_w, s_w))
        assert err < TOL[BF16] * 2, err
        xa = exact_e4m3(3, 256, seed=3)
        qa, sa = quantize_act(far(xa, ROW_STRIDE))
        rqa, rsa = fp8.quantize_act_ref(xa)
        assert torch.equal(sa, rsa) and torch.equal(qa.view(torch.uint8), rqa.view(torch.uint8)), "act quant"
        return {"weight-rows": err}

    def case(m, k, n, big):
        x = randn_dev(m, k, seed=1)
        q_w, s_w = fp8.quantize(randn_dev(n, k, seed=2).mul_(0.05))
        y = fp8_linear(x, q_w, s_w)
        if big == "weight":
            r = past_2g(k)
            return max(rel(y[:, lo:hi], fp8.linear_ref(x, q_w[lo:hi], s_w[lo // 128: hi // 128]))
                       for lo, hi in ((0, 128), (r - 128, r + 128), (n - 128, n)))
        rows = boundary(m, n if big == "output" else k)
        return rel(y[rows], fp8.linear_ref(x[rows], q_w, s_w))

    out = {}
    for big, mkn in {"output": (16384, 1024, 151936), "weight": (64, 16384, 151936), "input": (139264, 16384, 128)}.items():
        out[big] = case(*mkn, big)
        assert out[big] < TOL[BF16] * 2, (big, out[big])
    return out


CHECKS = {"matmul": check_matmul, "matmul_tilings": check_matmul_tilings, "matmul_split": check_matmul_split, "matmul_tma": check_matmul_tma, "attention_configs": check_attention_configs, "grouped_matmul": check_grouped_matmul, "rms_norm": check_rms_norm, "log_softmax": check_log_softmax,
          "attention": check_attention, "decode_attention": check_decode_attention, "bi_decode": check_bi_decode,
          "fp8_matmul": check_fp8_matmul, "sampling": check_sampling, "varlen_attention": check_varlen_attention,
          "offsets": check_offsets, "matmul_2g": check_matmul_2g, "rms_norm_2g": check_rms_norm_2g,
          "log_softmax_2g": check_log_softmax_2g, "attention_2g": check_attention_2g,
          "decode_attention_2g": check_decode_attention_2g, "sampling_2g": check_sampling_2g, "fp8_2g": check_fp8_2g,
          "fp8_matmul_2g": check_fp8_matmul_2g}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="interpreter-sized shapes")
    p.add_argument("names", nargs="*", default=list(CHECKS))
    args = p.parse_args()
    failed = 0
    for name in args.names:
        try:
            result = {"check": name, "ok": True, "errors": CHECKS[name](args.small)}
        except Exception as e:  # report every check, then fail
            failed += 1
            result = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        print(json.dumps(result), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()  # the *_2g checks hold 5-15 GB while they run; give it back between checks
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
