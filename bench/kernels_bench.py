"""Batch-invariant kernels vs the default kernels (cuBLAS, SDPA, torch) on a GPU, measured side by side.

    python bench/kernels_bench.py        -> table + results/kernels.json

Ratios are default time / batch-invariant time (>= 1 means the invariant kernel is as fast). Shapes
are those of a Qwen2.5-0.5B-sized model at a training micro-batch (8k tokens) and a decode step (64
sequences); last, a whole forward of the model in true on-policy mode vs default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import bench, device_info, qwen3_0p5b, write

import lockstep_kernels as kernels
from lockstep_kernels.gpu.attention import bi_attention
from lockstep_kernels.gpu.log_softmax import bi_log_softmax
from lockstep_kernels.gpu.matmul import bi_linear
from lockstep_kernels.gpu.rms_norm import bi_rms_norm


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = []

    def add(name, default_fn, bi_fn, flops=None):
        t_def, t_bi = bench(default_fn), bench(bi_fn)
        row = {"op": name, "default_ms": t_def, "bi_ms": t_bi, "ratio": t_def / t_bi}
        if flops:
            row["default_tflops"], row["bi_tflops"] = flops / t_def / 1e9, flops / t_bi / 1e9
        rows.append(row)

    for m, k, n in [(8192, 896, 4864), (8192, 4864, 896), (8192, 896, 1152), (64, 896, 4864), (8192, 4096, 4096),
                    (4096, 2048, 6144)]:
        x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt) * 0.02
        add(f"linear {m}x{k}x{n}", lambda: F.linear(x, w), lambda: bi_linear(x, w), 2 * m * k * n)
    x = torch.randn(8192, 896, device=dev, dtype=dt)
    wn = torch.ones(896, device=dev, dtype=dt)
    from lockstep_kernels.torch_ref import rms_norm as torch_rms

    add("rms_norm 8192x896", lambda: torch_rms(x, wn, 1e-6), lambda: bi_rms_norm(x, wn, 1e-6))
    logits = torch.randn(2048, 151936, device=dev, dtype=dt)
    add("log_softmax 2048x151936", lambda: torch.log_softmax(logits.float(), -1), lambda: bi_log_softmax(logits))
    for b, t in [(8, 1024), (2, 4096)]:
        q = torch.randn(b, 14, t, 64, device=dev, dtype=dt)
        kk, vv = torch.randn(b, 2, t, 64, device=dev, dtype=dt), torch.randn(b, 2, t, 64, device=dev, dtype=dt)
        qpos = torch.arange(t, device=dev)[None].expand(b, t).contiguous()
        flops = 4 * b * 14 * t * t * 64 / 2
        add(f"attention prefill b{b} t{t}", lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True),
            lambda: bi_attention(q, kk, vv, qpos), flops)
    b, t = 64, 2048
    q = torch.randn(b, 14, 1, 64, device=dev, dtype=dt)
    kk, vv = torch.randn(b, 2, t, 64, device=dev, dtype=dt), torch.randn(b, 2, t, 64, device=dev, dtype=dt)
    qpos = torch.full((b, 1), t - 1, device=dev)
    add(f"attention decode b{b} kv{t}", lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True),
        lambda: bi_attention(q, kk, vv, qpos))

    # Whole model forward (packed 8 x 1024 tokens) through the shared model code.
    from pipeline.models.attention import PackedCausal
    from pipeline.models.qwen3 import Qwen3ForCausalLM

    args = qwen3_0p5b()
    model = Qwen3ForCausalLM(args).to(dev, dt).eval()
    ids = torch.randint(0, args.vocab_size, (8 * 1024,), device=dev)
    ctx = PackedCausal.from_lengths([1024] * 8, device=dev)
    score = torch.arange(8 * 1024, device=dev)

    def fwd():
        with torch.no_grad():
            return model(ids, ctx.positions, ctx, logits_at_M=score)

    def fwd_bi():
        with kernels.batch_invariant_mode(), torch.no_grad():
            return model(ids, ctx.positions, ctx, logits_at_M=score)

    add("model forward 0.5B 8x1024", fwd, fwd_bi)
    print(f"{'op':<34} {'default ms':>10} {'bi ms':>9} {'ratio':>6} {'TFLOP/s def/bi':>16}")
    for r in rows:
        tf = f"{r['default_tflops']:.0f}/{r['bi_tflops']:.0f}" if "bi_tflops" in r else ""
        print(f"{r['op']:<34} {r['default_ms']:10.3f} {r['bi_ms']:9.3f} {r['ratio']:6.2f} {tf:>16}")
    write("kernels", {"device": device_info(), "rows": rows})


if __name__ == "__main__":
    main()
