"""Trainer step throughput and MFU: FSDP2 (the trainer's own `shard`), bf16 compute, fp32 master weights,
packed sequences, per-token logprob loss, AdamW — against the measured bf16 matmul rate of the device.

    python bench/trainer_bench.py                 # GPU: 0.5B and 1.7B-class configs
    python bench/trainer_bench.py --compile       # also each with train.compile (torch.compile per layer)
    python bench/trainer_bench.py --tiny          # CPU-sized variant
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from bench.common import qwen3_0p5b, qwen3_1p7b, single_process_group, sync, write  # noqa: E402
from pipeline.models.attention import PackedCausal  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.logprobs import token_logprobs  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.trainer.fsdp import shard  # noqa: E402


def matmul_rate(device, n: int) -> float:
    """Dense bf16 (fp32 on CPU) matmul FLOP/s at n x n x n: the practical peak MFU is measured against."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def train_flops(args, lengths: list[int]) -> float:
    """Matmul FLOPs of forward + backward (3x forward): linear layers, LM head, causal attention."""
    h, L = args.hidden_size, args.num_hidden_layers
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size
    linear = 2 * sum(lengths) * (L * per_layer + h * args.vocab_size)
    attention = L * 2 * 2 * sum(n * n / 2 for n in lengths) * q  # QK^T and PV over the causal half
    return 3 * (linear + attention)


def step_time(args, device, lengths: list[int], steps: int, varlen: bool, compile: bool = False) -> tuple[float, float]:
    """(median step time, first step's mean token logprob) with the training attention through flash's varlen kernel
    (`varlen`) or the padded grid (SDPA with a mask, the path before it and the one CPUs take), and the
    decoder layers compiled or not."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(args).to(device)
    mesh = init_device_mesh(device.type, (1,))
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = shard(model, mesh, compute, compile=compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)  # as FSDPBackend
    ctx = PackedCausal.from_lengths(lengths, device=device, varlen=varlen)
    ids, score, targets, adv = packed_batch(args, device, lengths)
    t = median_step_time(lambda: model(ids, ctx.positions, ctx, None, logits_at_M=score), targets, adv, model, opt,
                         device, steps)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return t


def packed_batch(args, device, lengths: list[int]):
    """Random sequences of these lengths packed: (ids, scored positions, their targets, advantages)."""
    ids = torch.randint(0, args.vocab_size, (sum(lengths),), device=device)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    score = torch.cat([torch.arange(s, s + n - 1, device=device) for s, n in zip(starts, lengths)])
    return ids, score, ids[score + 1], torch.randn(len(score), device=device)


def mixed_lengths(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Lengths uniform in [lo, hi] up to `total` tokens (a packed RL micro-batch: responses of many lengths)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        out.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), total - sum(out)))
    return out


def median_step_time(logits_fn, targets, adv, model, opt, device, steps: int) -> tuple[float, float]:
    """(median seconds of a step (forward, policy-gradient loss, backward, clip, AdamW) after 2 warm-ups,
    the first step's mean token logprob: what two ways of computing the same model compare on)."""
    times, logprobs = [], []
    for i in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        lp = token_logprobs(logits_fn(), targets, 1.0)
        loss = -(lp * adv).mean()
        loss.backward()
        logprobs.append(lp.detach().mean())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], float(logprobs[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also with the decoder layers compiled (train.compile)")
    p.add_argument("--configs", nargs="*", help="only these rows, by index (0-3 on the GPU)")
    a = p.parse_args(argv)
    device = single_process_group(a.tiny, 29555)
    configs = ([("tiny-dense", model_preset("tiny-dense", 64, None, 0, None), "8 x 64", [64] * 8)] if a.tiny else
               [("0.5B", qwen3_0p5b(), "8 x 2048", [2048] * 8), ("1.7B", qwen3_1p7b(), "8 x 2048", [2048] * 8),
                ("0.5B", qwen3_0p5b(), "mixed 128-2048", mixed_lengths(16384, 128, 2048)),
                ("1.7B", qwen3_1p7b(), "mixed 128-2048", mixed_lengths(16384, 128, 2048))])
    peak = matmul_rate(device, 8192 if device.type == "cuda" else 512)
    if a.configs:
        configs = [configs[int(i)] for i in a.configs]
    variants = [(False, False)] + ([(True, False)] if device.type == "cuda" else [])  # (varlen, compiled)
    if a.compile:
        variants.append((device.type == "cuda", True))
    rows = []
    for name, args, packing, lengths in configs:
        tokens = sum(lengths)
        eager_lp = None
        for varlen, compiled in variants:
            t, lp = step_time(args, device, lengths, a.steps, varlen, compiled)
            if not compiled and varlen == variants[-1][0]:
                eager_lp = lp
            achieved = train_flops(args, lengths) / t
            rows.append({"config": name, "packing": packing, "sequences": len(lengths),
                         "attention": "varlen" if varlen else "grid", "compiled": compiled, "tokens_per_step": tokens,
                         "step_s": t, "tokens_per_s": tokens / t, "tflops": achieved / 1e12,
                         "mfu_vs_matmul": achieved / peak, "first_mean_logprob": lp,
                         "logprob_diff_vs_eager": abs(lp - eager_lp) if compiled else None})
            print(f"{name:>10} {packing:>15} ({len(lengths)} seqs), attention {rows[-1]['attention']:6s}"
                  f"{', compiled' if compiled else ''}: "
                  f"{tokens} tokens/step, {t * 1e3:8.1f} ms/step, {tokens / t:10.0f} tok/s, {achieved / 1e12:7.1f} "
                  f"TFLOP/s = {100 * achieved / peak:5.1f}% of the measured matmul rate ({peak / 1e12:.0f} TFLOP/s)"
                  + (f"; mean token logprob {lp:.4f}, eager {eager_lp:.4f}" if compiled else ""),
                  flush=True)
    dist.destroy_process_group()
    payload = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "matmul_tflops": peak / 1e12, "rows": rows, "torch": torch.__version__}
    print("wrote", write("trainer_tiny" if a.tiny else "trainer", payload))
    return payload


if __name__ == "__main__":
    main()
