"""Fused per-token logprob vs the naive torch path: peak memory and time, forward + backward.

    python bench/logprob_bench.py        -> table + results/logprob.json

Naive: torch.log_softmax(logits.float() / T).gather(target) (materialises fp32 [tokens, vocab]
copies). Fused: kernels.log_softmax.bi_token_logprob (max and sum passes per row, gather; backward
writes the gradient in the logits' dtype). Memory is the peak allocated above the logits themselves.
"""

from __future__ import annotations

import torch

from common import bench, device_info, write

from lockstep_kernels.gpu.log_softmax import bi_token_logprob


def naive(logits, t, temp):
    return torch.log_softmax(logits.float() / temp, -1).gather(-1, t[:, None]).squeeze(-1)


def measure(fn, logits, t):
    def step():
        x = logits.detach().requires_grad_()
        fn(x, t, 0.8).sum().backward()
        return x.grad

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    fwd_ms = bench(lambda: fn(logits, t, 0.8))
    both_ms = bench(step)
    return peak, fwd_ms, both_ms


def main() -> None:
    rows = []
    for tokens in (4096, 16384):
        logits = torch.randn(tokens, 151936, device="cuda", dtype=torch.bfloat16) * 3
        t = torch.randint(0, 151936, (tokens,), device="cuda")
        ref = naive(logits, t, 0.8)
        got = bi_token_logprob(logits, t, 0.8)
        err = float((got - ref).abs().max())
        pn, fn_, bn = measure(naive, logits, t)
        pf, ff, bf = measure(bi_token_logprob, logits, t)
        rows.append({"tokens": tokens, "vocab": 151936, "max_abs_err": err, "naive_peak_GB": pn / 1e9,
                     "fused_peak_GB": pf / 1e9, "mem_ratio": pf / pn, "naive_fwd_ms": fn_, "fused_fwd_ms": ff,
                     "naive_fwd_bwd_ms": bn, "fused_fwd_bwd_ms": bf, "speedup_fwd": fn_ / ff, "speedup_fwd_bwd": bn / bf})
        del logits
    print(f"{'tokens':>7} {'peak GB naive/fused':>20} {'mem ratio':>9} {'fwd ms naive/fused':>19} {'fwd+bwd ms':>16} {'err':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['naive_peak_GB']:9.2f}/{r['fused_peak_GB']:<9.2f} {r['mem_ratio']:9.3f}"
              f" {r['naive_fwd_ms']:9.2f}/{r['fused_fwd_ms']:<9.2f} {r['naive_fwd_bwd_ms']:7.2f}/{r['fused_fwd_bwd_ms']:<8.2f}"
              f" {r['max_abs_err']:8.1e}")
    write("logprob", {"device": device_info(), "rows": rows})


if __name__ == "__main__":
    main()
