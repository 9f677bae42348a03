"""Batch-invariant kernels vs the default kernels (cuBLAS, flash/SDPA, torch) on a GPU, measured side by side.

    python bench/kernels_bench.py                       -> table + results/kernels.json (the 0.5B table)
    python bench/kernels_bench.py --presets 0.5b,1.7b,4b,moe-small   -> kernels_presets.json (issue 27)

Ratios are default time / batch-invariant time (>= 1 means the invariant kernel is as fast). The first
form: shapes of a Qwen2.5-0.5B-sized model at a training micro-batch (8k tokens) and a decode step (64
sequences); last, a whole forward of the model in true on-policy mode vs default. --presets: every GEMM
of each preset (q, k/v, fused qkv, o, gate/up, fused gate_up, down, LM head at vocabulary 151936) at M
from 1 to 16384 tokens, and attention at each preset's heads: training (packed sequences: flash
attention's varlen kernel vs the batch-invariant kernel on the padded grid, what each mode runs) and
decode (one query per sequence over a KV cache: the default engine's split-KV kernel vs the batch-
invariant kernel). Each row is marked against issue 27's bar: >= 0.9x at M >= 64, >= 0.8x at decode sizes.
--presets' GEMM rows are device time, both kernels captured in a CUDA graph over weight copies that
together exceed the L2 (common.graph_ms: what the engine's decode graphs pay; the eager per-call times,
which include the Python launch cost, are kept beside them). Before 2026-12-07 they were eager only, and
at M <= 256 they ran up to 6x the tile probe's times for the same tiling (q 2048x2048 at M=1: 0.085 vs
0.014 ms on an H100), so they could not say what the kernel costs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common import bench, cold_copies, device_info, graph_ms, qwen3_0p5b, real_size, write

import lockstep_kernels as kernels
from lockstep_kernels.gpu.attention import bi_attention
from lockstep_kernels.gpu.log_softmax import bi_log_softmax
from lockstep_kernels.gpu.matmul import bi_linear
from lockstep_kernels.gpu.rms_norm import bi_rms_norm


def main_05b() -> None:
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


PRESETS = {"0.5b": "qwen3-0.5b", "1.7b": "qwen3-1.7b", "4b": "qwen3-4b", "moe-small": "qwen3-moe-small"}
M_SIZES = (1, 8, 64, 256, 1024, 4096, 16384)
DECODE_M = 64  # below this, a GEMM's M is a decode batch: the bar is 0.8x, not 0.9x


def gemm_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(projection, N, K) of every linear layer of the preset's attention and dense MLP, and its LM head
    (a MoE preset's experts are bench/moe_decode_bench.py's)."""
    a = real_size(preset)
    h, hd, nh, nkv = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads
    out = [("q", nh * hd, h), ("k/v", nkv * hd, h), ("qkv", (nh + 2 * nkv) * hd, h), ("o", h, nh * hd)]
    if not a.is_moe:
        i = a.intermediate_size
        out += [("gate/up", i, h), ("gate_up", 2 * i, h), ("down", h, i)]
    return out + [("lm_head", a.vocab_size, h)]


def bar(m: int) -> float:
    return 0.8 if m < DECODE_M else 0.9


def with_k_chunk(chunk: int, fn):
    """fn(*args) run with matmul.K_CHUNK[bf16] = chunk (the fixed split-K), restored after."""
    from lockstep_kernels.gpu import matmul

    def run(*args):
        saved = matmul.K_CHUNK[torch.bfloat16]
        matmul.K_CHUNK[torch.bfloat16] = chunk
        try:
            return fn(*args)
        finally:
            matmul.K_CHUNK[torch.bfloat16] = saved
    return run


def main_presets(presets: list[str], m_sizes: list[int], k_chunks: list[int] = ()) -> None:
    import torch.nn.functional as F

    from pipeline.models.attention import PackedCausal
    from lockstep_kernels.gpu.decode_attention import bi_decode_attention, decode_attention_fwd

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = []

    def add(preset, kind, name, m, default_fn, bi_fn, flops=None, need=None, extra=None):
        """A row: default_fn / bi_fn are timed by `bench`, or are times already (floats); `extra`: more
        fields (the GEMM rows' eager times)."""
        t_def = default_fn if isinstance(default_fn, float) else bench(default_fn)
        t_bi = bi_fn if isinstance(bi_fn, float) else bench(bi_fn)
        need = need or bar(m)
        row = {"preset": preset, "kind": kind, "op": name, "m": m, "default_ms": t_def, "bi_ms": t_bi,
               "ratio": t_def / t_bi, "bar": need, "meets": t_def / t_bi >= need, **(extra or {})}
        if flops:
            row["default_tflops"], row["bi_tflops"] = flops / t_def / 1e9, flops / t_bi / 1e9
        rows.append(row)
        eager = f"   (eager {extra['eager_default_ms']:.4f} / {extra['eager_bi_ms']:.4f} ms)" if extra else ""
        print(f"{preset:<9} {name:<26} M={m:<6} default {t_def:8.3f} ms  bi {t_bi:8.3f} ms  {row['ratio']:5.2f}x"
              f"  {'ok' if row['meets'] else 'BELOW ' + str(row['bar'])}{eager}", flush=True)
        write("kernels_presets", {"device": device_info(), "bars": {"m>=64": 0.9, "decode": 0.8}, "rows": rows})

    def add_gemm(preset, name, m, ws, x, t_default, bi_fn, flops):
        """A GEMM row timed as device time in a CUDA graph over cold weight copies (`graph_ms`): what a
        kernel costs the GPU. The eager `bench` times of the same calls (host launch cost included, which
        training's eager steps pay) ride along as eager_default_ms / eager_bi_ms. t_default: the default
        kernel's (graph, eager) times."""
        eager_bi = bench(lambda: bi_fn(x, ws[0]))
        extra = {"timing": "cuda graph, cold weights", "eager_default_ms": t_default[1], "eager_bi_ms": eager_bi,
                 "eager_ratio": t_default[1] / eager_bi}
        add(preset, "gemm", name, m, t_default[0], graph_ms(lambda i: bi_fn(x, ws[i]), len(ws)), flops, extra=extra)

    for key in presets:
        preset = PRESETS[key]
        for name, n, k in gemm_shapes(preset):
            ws = cold_copies(torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5)
            for m in m_sizes:
                x = torch.randn(m, k, device=dev, dtype=dt)
                t_default = (graph_ms(lambda i: F.linear(x, ws[i]), len(ws)), bench(lambda: F.linear(x, ws[0])))
                add_gemm(key, f"{name} {n}x{k}", m, ws, x, t_default, bi_linear, 2 * m * n * k)
                for chunk in k_chunks:  # the fixed split-K beside the unsplit kernel, same default time
                    add_gemm(key, f"{name} {n}x{k} (split-K {chunk})", m, ws, x, t_default,
                             with_k_chunk(chunk, bi_linear), 2 * m * n * k)
                del x
            del ws
            torch.cuda.empty_cache()
        a = real_size(preset)
        h, g, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        for seqs, length in [(8, 1024), (4, 4096)]:  # training micro-batches of 8k / 16k tokens
            n = seqs * length
            q = torch.randn(n, h, d, device=dev, dtype=dt)
            kk, vv = torch.randn(n, g, d, device=dev, dtype=dt), torch.randn(n, g, d, device=dev, dtype=dt)
            ctx = PackedCausal.from_lengths([length] * seqs, device=dev)

            def attend_bi():
                with kernels.batch_invariant_mode():
                    return ctx.attend(0, q, kk, vv)

            flops = 4 * seqs * h * length * length * d / 2
            add(key, "attention", f"prefill {seqs}x{length}", n, lambda: ctx.attend(0, q, kk, vv), attend_bi, flops)
            del q, kk, vv
        for seqs, length in [(1, 4096), (8, 4096), (64, 512), (128, 2048)]:  # decode steps over a KV cache
            q = torch.randn(seqs, h, d, device=dev, dtype=dt)
            kc = torch.randn(seqs, g, length, d, device=dev, dtype=dt)
            vc = torch.randn(seqs, g, length, d, device=dev, dtype=dt)
            lens = torch.full((seqs,), length, device=dev, dtype=torch.int32)
            qpos = torch.full((seqs, 1), length - 1, device=dev)
            t_default = bench(lambda: decode_attention_fwd(q, kc, vc, lens))
            add(key, "attention", f"decode b{seqs} kv{length}", seqs, t_default,
                lambda: bi_attention(q[:, :, None], kc, vc, qpos), need=0.8)
            add(key, "attention", f"decode b{seqs} kv{length} (bi decode kernel)", seqs, t_default,
                lambda: bi_decode_attention(q, kc, vc, lens), need=0.8)
            del q, kc, vc
        torch.cuda.empty_cache()
    below = [r for r in rows if not r["meets"]]
    print(f"{len(rows)} rows; below the bar: {len(below)} "
          f"(gemm {sum(r['kind'] == 'gemm' for r in below)}, attention {sum(r['kind'] == 'attention' for r in below)})")
    write("kernels_presets", {"device": device_info(), "bars": {"m>=64": 0.9, "decode": 0.8}, "rows": rows})


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", help="comma-separated: " + ",".join(PRESETS))
    p.add_argument("--m", default=",".join(map(str, M_SIZES)), help="GEMM token counts")
    p.add_argument("--k-chunk", default="", help="comma-separated matmul.K_CHUNK values: each GEMM also with that"
                   " fixed split-K, side by side (e.g. 512,1024)")
    args = p.parse_args()
    if args.presets:
        main_presets(args.presets.split(","), [int(m) for m in args.m.split(",")],
                     [int(c) for c in args.k_chunk.split(",") if c])
    else:
        main_05b()
