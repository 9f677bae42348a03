"""Checks of the Triton kernels, runnable two ways:

  TRITON_INTERPRET=1 python tests/triton_checks.py --small   (CPU interpreter; tests/test_kernels_triton.py)
  python tests/triton_checks.py                              (a GPU; bench/gpu_suite.sh runs it)

Each check compares with a torch reference over odd shapes (per-dtype tolerances, relative Frobenius
error vs an fp64 reference) and tests batch invariance bitwise. Prints one JSON line per check and
exits 1 if any fails.
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

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


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
    q, k, v = (randn(1, 4, 9, 16, seed=s).requires_grad_() for s in (4, 5, 6))
    qpos = torch.arange(9, device=DEV)[None]
    bi_attention(q, k, v, qpos).sum().backward()
    assert q.grad is not None and torch.isfinite(k.grad).all()
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


CHECKS = {"matmul": check_matmul, "rms_norm": check_rms_norm, "log_softmax": check_log_softmax,
          "attention": check_attention, "decode_attention": check_decode_attention,
          "fp8_matmul": check_fp8_matmul, "sampling": check_sampling, "varlen_attention": check_varlen_attention}


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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
