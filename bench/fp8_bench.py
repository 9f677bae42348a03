"""Blockwise FP8 weight sync: bytes and time against bf16, Triton against the torch reference.

For a 0.5B- and a 1.7B-class Qwen3 (random bf16 weights on the GPU):
  - every linear weight quantized by the Triton kernel and by the torch reference: mismatching bytes
    (q and scale_inv; goal 0) and the time of each, with the quantizer's GB/s against the measured
    device copy bandwidth;
  - the weight-sync stream's bytes, bf16 vs FP8 (fp8_stream: linear weights FP8 + scales, the rest bf16);
  - the colocated update on an engine (stage + apply, as bench/weight_sync_bench.py), bf16 vs FP8
    (FP8 adds the engine-side dequantization).

    python bench/fp8_bench.py            # GPU
    python bench/fp8_bench.py --tiny     # CPU-sized variant (torch reference only)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import copy_bandwidth, qwen3_0p5b, qwen3_1p7b, sync, write  # noqa: E402
from lockstep_kernels import fp8  # noqa: E402
from pipeline.models.config import model_preset  # noqa: E402
from pipeline.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from pipeline.rollout.engine.core import Engine  # noqa: E402
from pipeline.weights.quant import dequantize_fp8_pairs, fp8_stream, is_fp8_target  # noqa: E402


def timed(fn, device, reps=3):
    best, out = float("inf"), None
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(name, args, device, copy_gbps) -> dict:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(args).to(device=device, dtype=torch.bfloat16)
    state = {n: t.detach() for n, t in model.state_dict().items()}
    linear = {n: t for n, t in state.items() if is_fp8_target(n, t)}
    row = {"model": name, "params_M": sum(t.numel() for t in state.values()) / 1e6}
    if device.type == "cuda":
        from lockstep_kernels.gpu.fp8 import quantize_blockwise

        mism_q = mism_s = 0
        for t in linear.values():
            q1, s1 = quantize_blockwise(t)
            q2, s2 = fp8.quantize_ref(t)
            mism_q += int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum())
            mism_s += int((s1.view(torch.int32) != s2.view(torch.int32)).sum())
        row["triton_vs_ref_mismatched_bytes"] = mism_q
        row["triton_vs_ref_mismatched_scales"] = mism_s
        t_tri, _ = timed(lambda: [quantize_blockwise(t) for t in linear.values()], device)
        row["quantize_triton_ms"] = t_tri * 1e3
        moved = sum(t.numel() * 3 for t in linear.values())  # read 2 bytes, write 1
        row["quantize_gbps"] = moved / t_tri / 1e9
        row["quantize_vs_copy"] = row["quantize_gbps"] / copy_gbps
    t_ref, _ = timed(lambda: [fp8.quantize_ref(t) for t in linear.values()], device, reps=1 if device.type == "cpu" else 3)
    row["quantize_torch_ref_ms"] = t_ref * 1e3
    bf16_bytes = sum(t.numel() * t.element_size() for t in state.values())
    stream = list(fp8_stream(state.items()))
    fp8_bytes = sum(t.numel() * t.element_size() for _, t in stream)
    lin_bf16 = sum(t.numel() * 2 for t in linear.values())
    lin_fp8 = sum(t.numel() * t.element_size() for n, t in stream if is_fp8_target(n.removesuffix("_scale_inv"), t)
                  or n.endswith("_scale_inv"))
    row.update(sync_bytes_bf16_MB=bf16_bytes / 1e6, sync_bytes_fp8_MB=fp8_bytes / 1e6,
               sync_bytes_ratio=fp8_bytes / bf16_bytes, linear_bytes_ratio=lin_fp8 / lin_bf16)
    engine = Engine(Qwen3ForCausalLM(args).to(device=device, dtype=torch.bfloat16), max_running=1, context_length=64,
                    eos_token_ids=[0], device=device, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in engine.model.named_parameters()}
    plain = {n: t for n, t in state.items() if n in dtypes}
    t_bf16, _ = timed(lambda: engine.load_weights({n: t.clone() for n, t in plain.items()}, 1), device)
    staged = {n: t.clone() for n, t in stream if n.removesuffix("_scale_inv") in dtypes}
    t_fp8, _ = timed(lambda: engine.load_weights(dequantize_fp8_pairs(staged, dtypes), 2), device)
    row.update(update_bf16_ms=t_bf16 * 1e3, update_fp8_ms=t_fp8 * 1e3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU-sized model")
    a = p.parse_args()
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    copy_gbps = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20)) / 1e9
    models = ([("tiny-dense-256", model_preset("tiny-dense", 256, 1, 2, 0))] if a.tiny
              else [("qwen3-0.5B", qwen3_0p5b()), ("qwen3-1.7B", qwen3_1p7b())])
    rows = [measure(name, args, device, copy_gbps) for name, args in models]
    keys = list(rows[0])
    print(f"device {device}, copy bandwidth {copy_gbps:.0f} GB/s")
    for r in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print("wrote", write("fp8" + ("_tiny" if a.tiny else ""), {"device": str(device), "copy_gbps": copy_gbps,
                                                               "rows": rows, "keys": keys}))


if __name__ == "__main__":
    main()
